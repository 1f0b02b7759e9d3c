"""Slots, queue, rates and rejections in total and per engine, and a chart of the last minutes."""

from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPaintEvent, QPalette, QPen
from PySide6.QtWidgets import (QAbstractItemView, QGridLayout, QGroupBox, QHeaderView, QLabel,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from backend.app.activity import ActivityHistory, ActivitySample, EngineActivity

from studio.chart_frame import ChartFrame
from studio.widgets import secondary_label

__all__ = ["ActivityChart", "ActivityView", "describe_rejections", "engine_row"]

ENGINE_COLUMNS = ("Model", "Engine", "Slots busy", "Waiting for the model", "KV tokens reserved",
                  "Tokens/s", "Tokens generated")

# The only fixed colours of the app: series must stay apart in light and dark palettes.
ACTIVE_COLOUR = QColor("#3b82f6")
WAITING_COLOUR = QColor("#f59e0b")
TOKENS_COLOUR = QColor("#10b981")

REPAINT_INTERVAL_MS = 100  # at most ten repaints a second, however fast samples come

REASONS = {
    "server_is_overloaded": "queue full",
    "bodies_in_flight_full": "too many bodies at once",
    "prompt_counts_full": "too many counts at once",
    "queue_timeout": "waited too long",
    "model_not_ready": "model not ready",
    "invalid_api_key": "wrong or missing key",
    "too_many_failed_keys": "too many wrong keys",
    "origin_not_allowed": "foreign web page",
    "host_not_allowed": "foreign host name",
    "unsupported_content_type": "body not JSON",
    "invalid_request": "bad request",
    "request_too_large": "too large",
    "request_timeout": "sent too slowly",
    "keyless_requests_full": "too many without a key",
    "too_many_polls": "too many enrolment polls",
    "upstream_failed": "engine failed",
    "upstream_unavailable": "engine unreachable",
    "model_reloaded": "model reloaded",
}


class ActivityView(QWidget):
    def __init__(self, history: ActivityHistory | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history or ActivityHistory()
        self.values: dict[str, QLabel] = {}
        grid = QGridLayout()
        grid.setHorizontalSpacing(24)
        # The words of every tab: "Requests" are the models' (what the Requests tab lists
        # and the Pool counts per model); "Refused" and "Stopped by the client" likewise.
        fields = (("slots", "Slots busy"), ("kv", "KV tokens reserved"), ("waiting", "Waiting"),
                  ("requests_per_s", "Requests/s"), ("tokens_per_s", "Tokens/s"),
                  ("requests", "Requests"), ("cancellations", "Stopped by the client"),
                  ("rejections", "Refused"))
        for index, (key, title) in enumerate(fields):
            caption = secondary_label(title)
            caption.setWordWrap(False)
            value = QLabel("—")
            value.setAccessibleName(title)
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            if key != "rejections":
                font = value.font()
                font.setPointSizeF(font.pointSizeF() * 1.5)
                font.setBold(True)
                value.setFont(font)
            else:
                value.setWordWrap(True)
            self.values[key] = value
            row, column = divmod(index, 4)
            span = 2 if key == "rejections" else 1
            grid.addWidget(caption, row * 2, column, 1, span)
            grid.addWidget(value, row * 2 + 1, column, 1, span)
        for column in range(5):
            grid.setColumnStretch(column, 1)
        numbers = QGroupBox("Now, in total")
        numbers.setLayout(grid)

        self.engines = QTableWidget(0, len(ENGINE_COLUMNS))
        self.engines.setHorizontalHeaderLabels(list(ENGINE_COLUMNS))
        self.engines.setAccessibleName("Activity per engine")
        self.engines.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.engines.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.engines.verticalHeader().hide()
        self.engines.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.engines_box = QGroupBox("Now, per engine")
        engines_layout = QVBoxLayout(self.engines_box)
        engines_layout.addWidget(self.engines)
        self.engines_box.hide()

        self.chart = ActivityChart(self.history)
        chart_box = QGroupBox("Last five minutes")
        chart_layout = QVBoxLayout(chart_box)
        chart_layout.addWidget(self.chart)

        layout = QVBoxLayout(self)
        layout.addWidget(numbers)
        layout.addWidget(self.engines_box)
        layout.addWidget(chart_box, 1)

    def add_sample(self, sample: ActivitySample) -> None:
        self.history.add(sample)
        v = self.values
        v["slots"].setText(f"{sample.active} / {sample.slots_total}" if sample.slots_total else "— / —")
        v["kv"].setText(sample.kv_text)
        v["waiting"].setText(str(sample.waiting))
        v["requests_per_s"].setText(f"{sample.requests_per_s:.1f}")
        v["tokens_per_s"].setText(f"{sample.tokens_per_s:.0f}" if sample.tokens_generated is not None
                                  else "—")
        v["requests"].setText(f"{sample.requests:,}")
        v["cancellations"].setText(f"{sum(sample.cancellations.values()):,}")
        v["rejections"].setText(describe_rejections(sample.rejections))
        self._show_engines(sample.engines)
        self.chart.schedule_update()

    def engine_rows(self) -> list[tuple[str, ...]]:
        """What the per-engine table shows, row by row."""
        table = self.engines
        return [tuple(item.text() if (item := table.item(row, column)) is not None else ""
                      for column in range(table.columnCount()))
                for row in range(table.rowCount())]

    def _show_engines(self, engines: tuple[EngineActivity, ...]) -> None:
        table = self.engines
        if table.rowCount() != len(engines):
            table.setRowCount(len(engines))
        for row, engine in enumerate(engines):
            for column, text in enumerate(engine_row(engine)):
                item = table.item(row, column)
                if item is None:
                    table.setItem(row, column, QTableWidgetItem(text))
                elif item.text() != text:
                    item.setText(text)
        # One engine says nothing the totals do not: the table is for a pool.
        self.engines_box.setVisible(len(engines) > 1)


def engine_row(engine: EngineActivity) -> tuple[str, ...]:
    return (engine.model, engine.engine,
            f"{engine.active} / {engine.slots}" if engine.slots else "— / —",
            str(engine.waiting), engine.kv_text,
            f"{engine.tokens_per_s:.0f}" if engine.tokens_generated is not None else "—",
            f"{engine.tokens_generated:,}" if engine.tokens_generated is not None else "—")


def describe_rejections(rejections: dict[str, int]) -> str:
    total = sum(rejections.values())
    if not total:
        return "None"
    parts = [f"{REASONS.get(reason, reason.replace('_', ' '))}: {count:,}"
             for reason, count in sorted(rejections.items(), key=lambda kv: -kv[1])]
    return f"{total:,} — " + ", ".join(parts)


class ActivityChart(QWidget):
    """Requests running and waiting, and tokens per second, drawn from a ring buffer."""

    def __init__(self, history: ActivityHistory, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.setMinimumHeight(140)
        self.setAccessibleName("Activity chart")
        self.setAccessibleDescription("Requests running and waiting, and tokens per second, "
                                      "over the last five minutes.")
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(REPAINT_INTERVAL_MS)
        self._timer.timeout.connect(self.update)
        self.paints = 0

    def schedule_update(self) -> None:
        if not self._timer.isActive():
            self._timer.start()

    def paintEvent(self, _event: QPaintEvent) -> None:
        self.paints += 1
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        palette = self.palette()
        frame = ChartFrame.begin(self, painter)
        if frame is None:
            return
        grid, area, top, bottom = frame.grid, frame.area, frame.top, frame.bottom

        samples = self.history.samples()
        now = samples[-1].time if samples else 0.0
        window = self.history.seconds

        def x_of(t: float) -> float:
            return area.right() - (now - t) / window * area.width()

        frame.legend(((ACTIVE_COLOUR, "running"), (WAITING_COLOUR, "waiting"),
                      (grid, "slots"), (TOKENS_COLOUR, "tokens/s")))
        requests_max = max(2.0, self.history.peak("slots_total"), self.history.peak("active_peak"),
                           self.history.peak("waiting_peak"))
        tokens_max = max(10.0, self.history.peak("tokens_per_s"))
        frame.scales(_short(requests_max), _short(tokens_max), midline=True)
        minutes = range(int(window // 60) + 1)
        frame.time_axis((1 - m * 60 / window, "now" if m == 0 else f"−{m} min") for m in minutes)

        if len(samples) < 2:
            painter.setPen(palette.color(QPalette.ColorRole.PlaceholderText))
            painter.drawText(area, Qt.AlignmentFlag.AlignCenter, "Waiting for activity…")
            return

        visible = [s for s in samples if now - s.time <= window]
        painter.setClipRect(area)

        def y_of(pane: QRectF, value: float, top_value: float) -> float:
            return pane.bottom() - min(value, top_value) / top_value * pane.height()

        def line(pane: QRectF, values: list[float], top_value: float) -> QPainterPath:
            path = QPainterPath()
            for i, (s, value) in enumerate(zip(visible, values)):
                point = QPointF(x_of(s.time), y_of(pane, value, top_value))
                if i == 0:
                    path.moveTo(point)
                else:
                    path.lineTo(point)
            return path

        # Slots as a step line behind the rest.
        painter.setPen(QPen(grid, 1.5, Qt.PenStyle.DashLine))
        painter.drawPath(line(top, [float(s.slots_total) for s in visible], requests_max))
        # Running requests as a filled area.
        running = line(top, [float(s.active_peak) for s in visible], requests_max)
        area_path = QPainterPath(running)
        area_path.lineTo(QPointF(x_of(visible[-1].time), top.bottom()))
        area_path.lineTo(QPointF(x_of(visible[0].time), top.bottom()))
        area_path.closeSubpath()
        fill = QColor(ACTIVE_COLOUR)
        fill.setAlpha(70)
        painter.fillPath(area_path, fill)
        painter.setPen(QPen(ACTIVE_COLOUR, 1.5))
        painter.drawPath(running)
        painter.setPen(QPen(WAITING_COLOUR, 2))
        painter.drawPath(line(top, [float(s.waiting_peak) for s in visible], requests_max))
        painter.setPen(QPen(TOKENS_COLOUR, 2))
        painter.drawPath(line(bottom, [s.tokens_per_s for s in visible], tokens_max))


def _short(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}"
