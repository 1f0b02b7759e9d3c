"""Which llama-server is used; when there is none, build one or choose one."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from backend.llama.accelerators import Accelerators
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
        self.candidates = QLabel()
        self.candidates.setFont(monospace_font())
        self.candidates.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.candidates.setAccessibleName("Where llama-server was looked for")
        self.accelerators = QLabel("Looking for GPUs…")
        self.accelerators.setFont(monospace_font())
        self.accelerators.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.accelerators.setAccessibleName("Accelerators on this computer")
        self.backend_to_build = "cpu"

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
        layout.addWidget(self.candidates)
        layout.addWidget(self.accelerators)
        layout.addLayout(buttons)
        layout.addWidget(self.build_box, 1)
        layout.addStretch(0)

    def set_resolution(self, resolution: Resolution, building: bool = False) -> None:
        chosen = resolution.chosen
        if chosen is not None:
            self.summary.setText(f"Using llama-server: {chosen.path}")
            self.detail.setText(f"Found as the {chosen.source} engine ({chosen.reason}).")
            self.build_button.setText("Re&build llama-server" if chosen.source == "managed"
                                      else "&Build llama-server")
        else:
            self.summary.setText("No llama-server found")
            self.detail.setText("GGUF Studio needs llama.cpp's llama-server to run models. "
                                "Build it here from source (only a C/C++ compiler is needed), "
                                "or choose one you already have.")
            self.build_button.setText("&Build llama-server")
        self.build_button.setVisible(chosen is None or chosen.source == "managed" or building)
        self.candidates.setText("\n".join(resolution.describe()))
        self.build_button.setEnabled(not building)

    def set_accelerators(self, found: Accelerators) -> None:
        """What GPUs and toolkits this computer has; the build button builds the best engine."""
        self.backend_to_build = found.best_buildable()
        self.accelerators.setText("Accelerators (backend, usable here, why):\n"
                                  + "\n".join(found.describe()))
        if self.backend_to_build != "cpu":
            self.build_button.setText(f"&Build the {self.backend_to_build} engine")
        elif self.build_button.text().startswith("&Build the "):
            self.build_button.setText("&Build llama-server")

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
