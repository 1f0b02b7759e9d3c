"""A named key's usage over time in the Sharing tab: tokens (prompt and completion) and
requests (answered and refused) per bar, as backend.app.sharing.key_table sums them."""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import QWidget

from backend.app.sharing.key_table import CHART_SPANS, UsageChart, short_number, usage_chart

from studio.activity_view import ACTIVE_COLOUR, TOKENS_COLOUR, WAITING_COLOUR
from studio.chart_frame import ChartFrame

__all__ = ["KeyUsageChart"]


class KeyUsageChart(QWidget):
    """Tokens (prompt and completion) and requests (answered and refused) per bar, over
    the chosen span: the usage ledger's minutes, summed by backend.app.sharing.key_table."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.chart: UsageChart = usage_chart((), None, CHART_SPANS[0][0])
        self.setMinimumHeight(160)
        self.setAccessibleName("Key usage chart")
        self.setAccessibleDescription(self.chart.summary)

    def set_chart(self, chart: UsageChart) -> None:
        if chart != self.chart:
            self.chart = chart
            self.setAccessibleDescription(chart.summary)
            self.update()

    def paintEvent(self, _event: QPaintEvent) -> None:
        painter = QPainter(self)
        palette = self.palette()
        frame = ChartFrame.begin(self, painter)
        if frame is None:
            return
        grid, area, top, bottom = frame.grid, frame.area, frame.top, frame.bottom
        frame.legend(((ACTIVE_COLOUR, "prompt tokens"), (TOKENS_COLOUR, "completion tokens"),
                      (grid, "requests"), (WAITING_COLOUR, "refused")))
        chart = self.chart
        tokens_max = float(max(10, chart.peak_tokens))
        requests_max = float(max(2, chart.peak_requests))
        frame.scales(short_number(tokens_max), short_number(requests_max))
        frame.time_axis(chart.ticks)

        if not chart.requests and not chart.refusals:
            painter.setPen(palette.color(QPalette.ColorRole.PlaceholderText))
            painter.drawText(top, Qt.AlignmentFlag.AlignCenter, "No requests in this span")
            return
        slot = area.width() / max(1, len(chart.bins))
        bar = max(1.0, slot * 0.8)

        def stack(pane: QRectF, left: float, parts: tuple[tuple[int, QColor], ...],
                  top_value: float) -> None:
            base = pane.bottom()
            for value, colour in parts:
                if value <= 0:
                    continue
                height = min(value, top_value) / top_value * pane.height()
                painter.fillRect(QRectF(left, base - height, bar, height), colour)
                base -= height

        for index, counts in enumerate(chart.bins):
            left = area.left() + index * slot + (slot - bar) / 2
            stack(top, left, ((counts.prompt_tokens, ACTIVE_COLOUR),
                              (counts.completion_tokens, TOKENS_COLOUR)), tokens_max)
            stack(bottom, left, ((counts.requests, grid), (counts.refusals, WAITING_COLOUR)),
                  requests_max)
