"""Small widgets shared by the panels."""

from __future__ import annotations

import html
from typing import Callable

from PySide6.QtCore import QChildEvent, QEvent, QObject, Qt, QTimer
from PySide6.QtGui import QFont, QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QAbstractSpinBox, QComboBox, QLabel, QPlainTextEdit,
                               QPushButton, QTextEdit, QWidget)

__all__ = ["CopyButton", "guard_widgets", "heading", "monospace_font", "plain_label",
           "plain_tooltip", "secondary_label"]


def guard_widgets(root: QWidget) -> None:
    """Two rules for `root` and every widget in it, now and made later (once per root):

    - a spin box or combo box takes the wheel only when it has the focus (given by a
      click or Tab, never by the wheel): scrolling a page over one scrolls the page
      instead of changing a live setting the user only scrolled past;
    - a label shows its text as plain text unless it was made rich on purpose
      (`setTextFormat(Qt.RichText)`): model names, GGUF metadata, a hub's or another
      server's strings are never read as markup, links or images.

    Each widget is guarded when it is made ready (its parent hears it polished), not by a
    filter on the whole application: that one ran Python, and took the interpreter lock
    from the backend's thread, for each of the window's events (a thousand a second while
    the Chat tab streams), and the window's loop waited for it.  Text views, which
    repaint many times a second and hold no boxes or labels, go unwatched.

    Qt's tooltip label is left as Qt has it (it wraps rich text and shows plain text as
    it is): a tooltip holding such strings is made with `plain_tooltip`.
    """
    if root.property(_GUARDED) is None:
        _WidgetGuard(root).guard(root)


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
_TEXT_VIEWS = (QTextEdit, QPlainTextEdit)


class _WidgetGuard(QObject):
    """`guard_widgets`'s filter, on every widget guarded.  A wheel event it turns away is
    left unaccepted, so Qt hands it on to the box's parents: the scroll area under it
    scrolls."""

    def guard(self, widget: QWidget) -> None:
        """The rules for `widget` and the widgets in it, and a watch on it for those made
        later."""
        if widget.property(_GUARDED) is not None:
            return
        widget.setProperty(_GUARDED, True)
        if isinstance(widget, _VALUE_BOXES):
            # Not WheelFocus (the default of spin boxes): the wheel must not focus them.
            widget.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        elif isinstance(widget, QLabel) and widget.textFormat() == Qt.TextFormat.AutoText \
                and widget.windowType() != Qt.WindowType.ToolTip:
            widget.setTextFormat(Qt.TextFormat.PlainText)
        if isinstance(widget, _TEXT_VIEWS):
            return  # it repaints often, and holds no boxes or labels
        widget.installEventFilter(self)
        for child in widget.children():
            if isinstance(child, QWidget):
                self.guard(child)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind == QEvent.Type.Wheel:
            if isinstance(watched, _VALUE_BOXES) and not watched.hasFocus():
                event.ignore()
                return True
        elif kind == QEvent.Type.ChildPolished and isinstance(event, QChildEvent):
            child = event.child()
            if isinstance(child, QWidget):  # made ready: a row, a page, a dialog
                self.guard(child)
        return False
