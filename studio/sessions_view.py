"""The agents' sessions: each live session per key and model, how much of its prompts
the engine's cache held, where its prefix lives, and its last miss and why.  Renders
rows the backend made (`backend.app.session_rows`); decides nothing."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QAbstractItemView, QHeaderView, QLabel, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from backend.app.session_rows import SessionRow

from studio.widgets import secondary_label

__all__ = ["COLUMNS", "MAX_ROWS", "SessionsView", "session_cells"]

COLUMNS = ("Key", "Session", "Model", "Turns", "Prompt cached", "Prefix lives on",
           "Last miss", "Idle")
#: The most recent sessions shown; the rest are counted.
MAX_ROWS = 200


class SessionsView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.summary = QLabel("No sessions yet.")
        self.summary.setAccessibleName("Sessions in total")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.setAccessibleName("Live sessions")
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.currentCellChanged.connect(lambda row, *_: self._show_details(row))
        # A row opens its whole story below (its last miss in full, which a cell cuts).
        self.details = QLabel()
        self.details.setWordWrap(True)
        self.details.setAccessibleName("Session details")
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._rows: tuple[SessionRow, ...] = ()
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(COLUMNS.index("Last miss"), QHeaderView.ResizeMode.Stretch)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.details)
        layout.addWidget(secondary_label(
            "A session is one agent's conversation (Codex, OpenCode and Claude Code name "
            "theirs; others are followed by their prompt). Prompt cached: the share of its "
            "prompt tokens the engine did not compute again."))

    def show_sessions(self, rows: Sequence[SessionRow]) -> None:
        shown = rows[:MAX_ROWS]
        self._rows = tuple(shown)
        table = self.table
        if table.rowCount() != len(shown):
            table.setRowCount(len(shown))
        for r, row in enumerate(shown):
            for column, text in enumerate(session_cells(row)):
                item = table.item(r, column)
                if item is None:
                    table.setItem(r, column, QTableWidgetItem(text))
                elif item.text() != text:
                    item.setText(text)
        self._show_details(table.currentRow())
        more = f" (the {MAX_ROWS} most recent shown)" if len(rows) > MAX_ROWS else ""
        self.summary.setText(f"{len(rows)} live session{'s' if len(rows) != 1 else ''}{more}."
                             if rows else "No sessions yet.")

    def rows(self) -> list[tuple[str, ...]]:
        """What the table shows, row by row."""
        table = self.table
        return [tuple(item.text() if (item := table.item(r, c)) is not None else ""
                      for c in range(table.columnCount()))
                for r in range(table.rowCount())]


    def _show_details(self, index: int) -> None:
        if not 0 <= index < len(self._rows):
            self.details.setText("Select a session to see its details.")
            return
        row = self._rows[index]
        text = (f"{row.name} — {row.owner}, {row.model}: {row.turns} turn"
                f"{'s' if row.turns != 1 else ''}, {row.hit_percent:.0f} % of its prompt "
                f"tokens found cached; its prefix lives on {row.where}; idle "
                f"{_idle(row.idle_seconds)}.")
        if row.last_miss:
            text += f" Last miss: {row.last_miss}."
        self.details.setText(text + " Its requests: the Requests tab, filtered by key "
                                    f"{row.owner!r}.")


def session_cells(row: SessionRow) -> tuple[str, ...]:
    return (row.owner, row.name, row.model, str(row.turns),
            f"{row.hit_percent:.0f} %", row.where, row.last_miss or "—",
            _idle(row.idle_seconds))


def _idle(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
