"""Which llama-server is used; when there is none, build one or choose one."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QTextOption
from PySide6.QtWidgets import (
    QFileDialog,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QToolButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from backend.llama.accelerators import PREFERENCE, Accelerators
from backend.llama.engine import BuildProgress, Resolution

from studio.widgets import heading, monospace_font, secondary_label

__all__ = ["EngineView"]

PHASES = {"fetch": "Fetching the llama.cpp sources", "configure": "Configuring",
          "compile": "Compiling llama-server", "install": "Installing", "done": "Done"}


class EngineView(QWidget):
    build_requested = Signal()
    binary_chosen = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.summary = heading("", 1.15)
        self.summary.setWordWrap(True)
        self.detail = secondary_label()
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # The binary's path in a field of its own: selectable, never cut off the page.
        self.path = QLineEdit()
        self.path.setReadOnly(True)
        self.path.setAccessibleName("The llama-server used")
        self.path.hide()
        # The GPUs and toolkits as a table, one backend a row, what to install under it.
        self.accelerator_table = QTreeWidget()
        self.accelerator_table.setColumnCount(3)
        self.accelerator_table.setHeaderLabels(["Backend", "Usable here", "Why"])
        self.accelerator_table.setAccessibleName("Accelerators on this computer")
        self.accelerator_table.setRootIsDecorated(False)
        self.accelerator_table.setWordWrap(True)
        self.accelerator_table.setSelectionMode(QTreeWidget.SelectionMode.NoSelection)
        self.accelerator_table.header().setStretchLastSection(True)
        self.accelerator_table.header().setSectionResizeMode(
            0, QHeaderView.ResizeMode.ResizeToContents)
        self.accelerator_table.header().setSectionResizeMode(
            1, QHeaderView.ResizeMode.ResizeToContents)
        self.accelerators = secondary_label("Looking for GPUs…")
        self.accelerators.setAccessibleName("Accelerators found")
        self.backend_to_build = "cpu"
        # Where each candidate binary was looked for: on request.
        self.looked_button = QToolButton()
        self.looked_button.setText("Where GGUF Studio looked for llama-server")
        self.looked_button.setCheckable(True)
        self.looked_button.setAutoRaise(True)
        self.looked_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.looked_button.setArrowType(Qt.ArrowType.RightArrow)
        self.candidates = QPlainTextEdit()
        self.candidates.setReadOnly(True)
        self.candidates.setFont(monospace_font())
        self.candidates.setLineWrapMode(QPlainTextEdit.LineWrapMode.WidgetWidth)
        self.candidates.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.candidates.setAccessibleName("Where llama-server was looked for")
        self.candidates.setMaximumHeight(self.candidates.fontMetrics().lineSpacing() * 8 + 12)
        self.candidates.hide()
        self.looked_button.toggled.connect(self._show_looked)

        self.build_button = QPushButton("&Build llama-server")
        self.build_button.setToolTip("Compile llama-server from the llama.cpp sources on this "
                                     "computer (about 6–8 minutes on two cores).")
        self.build_button.clicked.connect(self.build_requested)
        self.choose_button = QPushButton("C&hoose a llama-server binary…")
        self.choose_button.clicked.connect(self._choose)
        buttons = QHBoxLayout()
        buttons.addWidget(self.build_button)
        buttons.addWidget(self.choose_button)
        buttons.addStretch(1)

        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setAccessibleName("Build progress")
        self.phase = QLabel()
        self.build_log = QPlainTextEdit()
        self.build_log.setReadOnly(True)
        self.build_log.setFont(monospace_font())
        self.build_log.setMaximumBlockCount(500)
        self.build_log.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.build_log.setAccessibleName("Build output")
        self.build_box = QGroupBox("Build")
        build_layout = QVBoxLayout(self.build_box)
        build_layout.addWidget(self.phase)
        build_layout.addWidget(self.progress)
        build_layout.addWidget(self.build_log, 1)
        self.build_box.hide()

        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.detail)
        layout.addWidget(self.path)
        layout.addLayout(buttons)
        layout.addWidget(self.build_box, 1)
        layout.addWidget(self.accelerators)
        layout.addWidget(self.accelerator_table, 1)
        layout.addWidget(self.looked_button, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.candidates)

    def set_resolution(self, resolution: Resolution, building: bool = False) -> None:
        chosen = resolution.chosen
        self.path.setVisible(chosen is not None)
        if chosen is not None:
            self.summary.setText("llama-server is ready to use")
            self.detail.setText(f"Found as the {chosen.source} engine ({chosen.reason}):")
            self.path.setText(str(chosen.path))
            self.path.setCursorPosition(0)
            self.build_button.setText("Re&build llama-server" if chosen.source == "managed"
                                      else "&Build llama-server")
        else:
            self.summary.setText("No llama-server found")
            self.detail.setText("GGUF Studio needs llama.cpp's llama-server to run models. "
                                "Build it here from source (only a C/C++ compiler is needed), "
                                "or choose one you already have.")
            self.build_button.setText("&Build llama-server")
        self.build_button.setVisible(chosen is None or chosen.source == "managed" or building)
        self.candidates.setPlainText("\n".join(resolution.describe()))
        self.build_button.setEnabled(not building)

    def set_accelerators(self, found: Accelerators) -> None:
        """What GPUs and toolkits this computer has; the build button builds the best engine."""
        self.backend_to_build = found.best_buildable()
        usable = [b.backend for b in found.backends if b.usable and b.backend != "cpu"]
        self.accelerators.setText(
            "GPUs: " + (", ".join(usable) + " usable here." if usable else
                        "none usable here; models run on the CPU.") + " What each needs:")
        table = self.accelerator_table
        table.clear()
        for backend in sorted(found.backends, key=lambda b: PREFERENCE.index(b.backend)):
            row = QTreeWidgetItem([backend.backend, "yes" if backend.usable else "no",
                                   backend.reason])
            for device in backend.devices:
                memory = f", {device.memory_mib:,} MiB" if device.memory_mib else ""
                row.addChild(QTreeWidgetItem(["", "", f"device: {device.name}{memory}"]))
            toolkit = backend.toolkit
            if backend.backend != "cpu" and (backend.devices or toolkit.present or toolkit.install):
                row.addChild(QTreeWidgetItem(["", "", ("toolkit ok: " if toolkit.present else
                                                       "toolkit missing: ") + toolkit.reason]))
                if toolkit.install:
                    row.addChild(QTreeWidgetItem(["", "", f"install: {toolkit.install}"]))
            table.addTopLevelItem(row)
            row.setExpanded(True)
        if self.backend_to_build != "cpu":
            self.build_button.setText(f"&Build the {self.backend_to_build} engine")
        elif self.build_button.text().startswith("&Build the "):
            self.build_button.setText("&Build llama-server")

    def accelerator_rows(self) -> list[tuple[str, str, str]]:
        """What the accelerators' table shows, row by row (a backend, then its lines)."""
        found: list[tuple[str, str, str]] = []
        table = self.accelerator_table
        for index in range(table.topLevelItemCount()):
            item = table.topLevelItem(index)
            if item is None:
                continue
            found.append((item.text(0), item.text(1), item.text(2)))
            for child in range(item.childCount()):
                line = item.child(child)
                if line is not None:
                    found.append((line.text(0), line.text(1), line.text(2)))
        return found

    def _show_looked(self, shown: bool) -> None:
        self.looked_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        self.candidates.setVisible(shown)

    def show_progress(self, events: list[BuildProgress]) -> None:
        self.build_box.show()
        self.build_button.setEnabled(False)
        last = events[-1]
        self.progress.setValue(int(last.percent))
        self.phase.setText(f"{PHASES.get(last.phase, last.phase)} — {last.percent:.0f} %")
        lines = [e.line for e in events if e.line]
        if lines:
            self.build_log.appendPlainText("\n".join(lines))

    def show_finished(self, result: object) -> None:
        self.build_box.show()
        self.build_button.setEnabled(True)
        if isinstance(result, Path):
            self.progress.setValue(100)
            self.phase.setText(f"Built {result}")
        else:
            self.phase.setText(f"The build failed: {result}")

    def _choose(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a llama-server binary")
        if path:
            self.binary_chosen.emit(path)
