"""The llama-server log and the port's access log: a filterable tail."""

from __future__ import annotations

from collections import deque
from pathlib import Path

from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from backend.llama.log import is_routine
from studio.widgets import monospace_font

__all__ = ["LogsView"]

MAX_LINES = 5000
SOURCES = (("All logs", None), ("llama-server", "llama-server"), ("Access log", "access"))


class LogsView(QWidget):
    def __init__(self, log_dir: Path, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.log_dir = Path(log_dir)
        self._lines: deque[tuple[str, str]] = deque(maxlen=MAX_LINES)

        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter lines")
        self.filter.setClearButtonEnabled(True)
        self.filter.setAccessibleName("Filter log lines")
        self.filter.textChanged.connect(self._rerender)
        self.source = QComboBox()
        self.source.setAccessibleName("Which log")
        for label, _ in SOURCES:
            self.source.addItem(label)
        self.source.currentIndexChanged.connect(self._rerender)
        self.routine = QCheckBox("R&outine lines")
        self.routine.setToolTip("Show the lines an idle engine writes over and over (\"all "
                                "slots are idle\", the port's health and slot polls).")
        self.routine.toggled.connect(self._rerender)
        self.follow = QCheckBox("Follo&w")
        self.follow.setChecked(True)
        self.follow.setToolTip("Keep the newest lines in view")
        self.follow.toggled.connect(lambda on: self._scroll_to_end() if on else None)
        self.open_folder = QPushButton("Open log folde&r")
        self.open_folder.clicked.connect(self._open_folder)

        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setFont(monospace_font())
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.text.setMaximumBlockCount(MAX_LINES)
        self.text.setAccessibleName("Log")
        self.text.setTabChangesFocus(True)

        bar = QHBoxLayout()
        bar.addWidget(self.filter, 1)
        bar.addWidget(self.source)
        bar.addWidget(self.routine)
        bar.addWidget(self.follow)
        bar.addWidget(self.open_folder)
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(self.text, 1)

    def add_lines(self, lines: list[tuple[str, str]]) -> None:
        self._lines.extend(lines)
        shown = [self._format(line) for line in lines if self._matches(line)]
        if not shown:
            return
        bar = self.text.verticalScrollBar()
        position = bar.value()
        # One insertion per batch: appending line by line costs a layout pass each.
        self.text.appendPlainText("\n".join(shown))
        if self.follow.isChecked():
            self._scroll_to_end()
        else:
            bar.setValue(position)

    def visible_text(self) -> str:
        return self.text.toPlainText()

    def _matches(self, line: tuple[str, str]) -> bool:
        source, text = line
        wanted = SOURCES[self.source.currentIndex()][1]
        needle = self.filter.text().strip().lower()
        if source == "llama-server" and not self.routine.isChecked() and is_routine(text):
            return False
        return (wanted is None or source == wanted) and (not needle or needle in text.lower())

    def _format(self, line: tuple[str, str]) -> str:
        source, text = line
        return f"[{'access' if source == 'access' else 'engine'}] {text}" \
            if SOURCES[self.source.currentIndex()][1] is None else text

    def _rerender(self) -> None:
        self.text.setPlainText("\n".join(self._format(line) for line in self._lines
                                         if self._matches(line)))
        self._scroll_to_end()

    def _scroll_to_end(self) -> None:
        bar = self.text.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _open_folder(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.log_dir)))
