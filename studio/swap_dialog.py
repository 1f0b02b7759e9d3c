"""The questions a load or an unload asks while other models serve: replace the default
model or add beside it, and which model `default` names after the default one goes.  The
words are `backend.app.model_swap`'s; these dialogs show them and return the choice."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QRadioButton,
    QVBoxLayout,
    QWidget,
)

from backend.app.model_swap import LoadChoice, LoadQuestion, UnloadQuestion
from backend.models.model_names import DEFAULT_MODEL_ALIAS

from studio.widgets import heading, secondary_label

__all__ = ["LoadDialog", "UnloadDialog"]


class LoadDialog(QDialog):
    """Replace the default model, or add beside it (and maybe make it `default`).  Add
    beside is chosen at first: it changes nothing for anyone else."""

    def __init__(self, question: LoadQuestion, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(question.title)
        self.beside = QRadioButton(f"&Add {question.new} beside {question.current}")
        self.replace = QRadioButton(f"&Replace {question.current} with {question.new}")
        own_words, what_it_does = _split(question.make_default)
        self.make_default = QCheckBox(own_words)
        self.make_default.setAccessibleDescription(what_it_does)
        group = QButtonGroup(self)
        for button in (self.beside, self.replace):
            group.addButton(button)
        self.beside.setChecked(True)
        self.replace.toggled.connect(lambda on: self.make_default.setEnabled(not on))
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                        | QDialogButtonBox.StandardButton.Cancel)
        ok = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        if ok is not None:
            ok.setText("Load")
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)

        layout = QVBoxLayout(self)
        layout.addWidget(heading(question.title, 1.15))
        layout.addWidget(_words(question.now))
        layout.addWidget(self.beside)
        layout.addWidget(_indented(secondary_label(question.beside.removeprefix("Add beside: "))))
        layout.addWidget(_indented(self.make_default, secondary_label(what_it_does)))
        layout.addWidget(self.replace)
        layout.addWidget(_indented(secondary_label(question.replace.removeprefix("Replace: "))))
        layout.addWidget(self.buttons)
        self.setMinimumWidth(self.fontMetrics().horizontalAdvance("x") * 80)

    def choice(self) -> LoadChoice:
        """What the owner picked (read it once the dialog was accepted)."""
        if self.replace.isChecked():
            return LoadChoice.REPLACE
        return LoadChoice.BESIDE_AS_DEFAULT if self.make_default.isChecked() else LoadChoice.BESIDE


class UnloadDialog(QDialog):
    """Unload the default model: which model `default` names from now on."""

    def __init__(self, question: UnloadQuestion, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(question.title)
        self.next_default = QComboBox()
        self.next_default.setAccessibleName(f"Model {DEFAULT_MODEL_ALIAS} names from now on")
        for name in question.others:
            self.next_default.addItem(name, name)
        self.next_default.addItem("No model (refused until a load)", None)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                        | QDialogButtonBox.StandardButton.Cancel)
        ok = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        if ok is not None:
            ok.setText("Unload")
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        form = QFormLayout()
        form.addRow(f"`{DEFAULT_MODEL_ALIAS}` names:", self.next_default)
        layout = QVBoxLayout(self)
        layout.addWidget(heading(question.title, 1.15))
        layout.addWidget(_words(question.text))
        layout.addLayout(form)
        layout.addWidget(self.buttons)
        self.setMinimumWidth(self.fontMetrics().horizontalAdvance("x") * 70)

    def new_default(self) -> str | None:
        data = self.next_default.currentData()
        return str(data) if data is not None else None


def _words(text: str) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    return label


def _split(text: str) -> tuple[str, str]:
    """A checkbox's own words (up to the colon) and what it does (the rest)."""
    own, _colon, rest = text.partition(": ")
    own = own.removeprefix("…and ")
    rest = rest.strip()
    return own[:1].upper() + own[1:], rest[:1].upper() + rest[1:]


def _indented(*widgets: QWidget) -> QWidget:
    holder = QWidget()
    layout = QVBoxLayout(holder)
    layout.setContentsMargins(24, 0, 0, 6)
    for widget in widgets:
        layout.addWidget(widget)
    return holder
