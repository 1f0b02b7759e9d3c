"""The frame both charts draw in: a legend, two stacked panes with their scales, and a
time axis below; what goes inside the panes is each chart's own."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFontMetrics, QPainter, QPalette, QPen
from PySide6.QtWidgets import QWidget

__all__ = ["ChartFrame"]

MARGIN = 8


@dataclass
class ChartFrame:
    painter: QPainter
    metrics: QFontMetrics
    text: QColor
    grid: QColor
    margin_left: float
    area: QRectF  #: both panes, the gap between them included
    top: QRectF
    bottom: QRectF

    @classmethod
    def begin(cls, widget: QWidget, painter: QPainter) -> ChartFrame | None:
        """Fill `widget`'s background and lay the frame out; None when it is too small."""
        palette = widget.palette()
        painter.fillRect(widget.rect(), palette.color(QPalette.ColorRole.Base))
        metrics = painter.fontMetrics()
        margin_left = metrics.horizontalAdvance("00000") + 8
        legend_h = metrics.height() + 6
        axis_h = metrics.height() + 4
        area = QRectF(margin_left, MARGIN + legend_h, widget.width() - margin_left - MARGIN,
                      widget.height() - 2 * MARGIN - legend_h - axis_h)
        if area.width() < 20 or area.height() < 40:
            return None
        gap = metrics.height()
        top = QRectF(area.left(), area.top(), area.width(), (area.height() - gap) * 0.6)
        bottom = QRectF(area.left(), top.bottom() + gap, area.width(),
                        area.height() - top.height() - gap)
        return cls(painter, metrics, palette.color(QPalette.ColorRole.Text),
                   palette.color(QPalette.ColorRole.Mid), margin_left, area, top, bottom)

    def legend(self, items: Iterable[tuple[QColor, str]]) -> None:
        """The colours' names above the panes; where they do not all fit in the chart's
        width, each by its first word ("prompt tokens": "prompt"), the scales saying what
        is counted."""
        painter, metrics = self.painter, self.metrics
        items = list(items)
        x = self.margin_left
        if x + sum(32 + metrics.horizontalAdvance(label) for _, label in items) > self.area.right():
            items = [(colour, label.split()[0]) for colour, label in items]
        for colour, label in items:
            painter.fillRect(QRectF(x, MARGIN + 3, 12, metrics.height() - 6), colour)
            painter.setPen(self.text)
            painter.drawText(QPointF(x + 16, MARGIN + metrics.ascent()), label)
            x += 16 + metrics.horizontalAdvance(label) + 16

    def scales(self, top_label: str, bottom_label: str, *, midline: bool = False) -> None:
        """Each pane's border and its scale, from 0 to the label given (`midline`: a
        dotted line halfway)."""
        painter, metrics = self.painter, self.metrics
        for pane, label in ((self.top, top_label), (self.bottom, bottom_label)):
            painter.setPen(QPen(self.grid, 1))
            painter.drawRect(pane)
            if midline:
                y = pane.bottom() - 0.5 * pane.height()
                painter.setPen(QPen(self.grid, 1, Qt.PenStyle.DotLine))
                painter.drawLine(QPointF(pane.left(), y), QPointF(pane.right(), y))
            painter.setPen(self.text)
            painter.drawText(QRectF(0, pane.top() - 2, self.margin_left - 6, metrics.height()),
                             Qt.AlignmentFlag.AlignRight, label)
            painter.drawText(QRectF(0, pane.bottom() - metrics.height() + 2,
                                    self.margin_left - 6, metrics.height()),
                             Qt.AlignmentFlag.AlignRight, "0")

    def time_axis(self, ticks: Iterable[tuple[float, str]]) -> None:
        """Labels under the panes, each at a fraction of the width from the left, kept
        inside it."""
        painter, metrics, area = self.painter, self.metrics, self.area
        painter.setPen(self.text)
        for fraction, label in ticks:
            width = metrics.horizontalAdvance(label)
            x = area.left() + fraction * area.width()
            painter.drawText(QPointF(min(max(x - width / 2, area.left()), area.right() - width),
                                     area.bottom() + metrics.ascent() + 2), label)
