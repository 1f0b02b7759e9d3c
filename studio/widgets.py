"""Small widgets shared by the panels."""

from __future__ import annotations

import html
from typing import Callable

from PySide6.QtCore import QCoreApplication, QEvent, QObject, Qt, QTimer
from PySide6.QtGui import QFont, QFontDatabase, QGuiApplication
from PySide6.QtWidgets import QAbstractSpinBox, QComboBox, QLabel, QPushButton, QWidget

__all__ = ["CopyButton", "guard_widgets", "heading", "monospace_font", "plain_label",
           "plain_tooltip", "secondary_label"]


def guard_widgets(app: QCoreApplication) -> None:
    """Two rules for every widget of the application, on every page and in every row
    made later (once per application):

    - a spin box or combo box takes the wheel only when it has the focus (given by a
      click or Tab, never by the wheel): scrolling a page over one scrolls the page
      instead of changing a live setting the user only scrolled past;
    - a label shows its text as plain text unless it was made rich on purpose
      (`setTextFormat(Qt.RichText)`): model names, GGUF metadata, a hub's or another
      server's strings are never read as markup, links or images.

    Qt's tooltip label is left as Qt has it (it wraps rich text and shows plain text as
    it is): a tooltip holding such strings is made with `plain_tooltip`.
    """
    if app.property(_GUARDED) is None:
        guard = _WidgetGuard(app)
        app.installEventFilter(guard)
        app.setProperty(_GUARDED, True)


def plain_tooltip(text: str) -> str:
    """`text` as a tooltip that shows it as it is (Qt reads tooltips as rich text
    whenever they look like markup)."""
    return f"<p style='white-space:pre-wrap'>{html.escape(text)}</p>"


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


def plain_label(text: str = "") -> QLabel:
    """A label that shows `text` as it is: for strings a model file or another server
    gave, which must not be read as rich text (markup, links, images)."""
    label = QLabel(text)
    label.setTextFormat(Qt.TextFormat.PlainText)
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
            self.setToolTip(plain_tooltip(accessible_name))
        self.clicked.connect(self._copy)

    def _copy(self) -> None:
        QGuiApplication.clipboard().setText(self._source())
        self.setText("Copied")
        QTimer.singleShot(1200, self, self._restore)

    def _restore(self) -> None:
        self.setText(self._label)


# --- helpers ----------------------------------------------------------------------------

_GUARDED = "gguf_studio_widget_guard"
_VALUE_BOXES = (QAbstractSpinBox, QComboBox)


class _WidgetGuard(QObject):
    """`guard_widgets`'s filter.  A wheel event it turns away is left unaccepted, so Qt
    hands it on to the box's parents: the scroll area under it scrolls."""

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind == QEvent.Type.Wheel:
            if isinstance(watched, _VALUE_BOXES) and not watched.hasFocus():
                event.ignore()
                return True
        elif kind == QEvent.Type.Polish:
            if isinstance(watched, _VALUE_BOXES):
                # Not WheelFocus (the default of spin boxes): the wheel must not focus them.
                watched.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
            elif isinstance(watched, QLabel) and watched.textFormat() == Qt.TextFormat.AutoText \
                    and watched.windowType() != Qt.WindowType.ToolTip:
                watched.setTextFormat(Qt.TextFormat.PlainText)
        return False
