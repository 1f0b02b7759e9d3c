"""Small widgets shared by the panels."""

from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFont, QFontDatabase, QGuiApplication
from PySide6.QtWidgets import QLabel, QPushButton, QWidget

__all__ = ["CopyButton", "heading", "monospace_font", "secondary_label"]


def monospace_font() -> QFont:
    return QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)


def heading(text: str, scale: float = 1.35) -> QLabel:
    label = QLabel(text)
    font = label.font()
    font.setPointSizeF(font.pointSizeF() * scale)
    font.setBold(True)
    label.setFont(font)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


def secondary_label(text: str = "") -> QLabel:
    """A label in the palette's placeholder colour, for hints and secondary facts."""
    label = QLabel(text)
    label.setWordWrap(True)
    label.setForegroundRole(label.palette().ColorRole.PlaceholderText)
    return label


class CopyButton(QPushButton):
    """Copies `text()` of its source to the clipboard and says so for a moment."""

    def __init__(self, text_source: Callable[..., str], label: str = "Copy", parent: QWidget | None = None,
                 accessible_name: str = "") -> None:
        super().__init__(label, parent)
        self._source = text_source
        self._label = label
        if accessible_name:
            self.setAccessibleName(accessible_name)
            self.setToolTip(accessible_name)
        self.clicked.connect(self._copy)

    def _copy(self) -> None:
        QGuiApplication.clipboard().setText(self._source())
        self.setText("Copied")
        QTimer.singleShot(1200, self, self._restore)

    def _restore(self) -> None:
        self.setText(self._label)
