"""The selected model's card, its load settings, and the Load / Unload controls."""

from __future__ import annotations

import shlex

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QStyle,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from backend.errors import SettingsError
from backend.app.model_account import ModelAccount
from backend.memory_size import format_memory
from backend.models.fit import load_memory
from backend.models.gguf_info import ModelInfo, format_file_size, format_parameter_count
from backend.gpu_layers import parse_gpu_layers
from backend.rpc_workers import parse_rpc_workers
from backend.llama.chat_template import BUILT_IN_TEMPLATES, NO_TEMPLATE, OWN_TEMPLATE, ChatTemplate
from backend.llama.load import THREADS_HELP, LoadSettings, Snapshot, State

from studio.widgets import heading, plain_tooltip, secondary_label

__all__ = ["ModelView", "describe_state"]


class ModelView(QWidget):
    load_requested = Signal()
    unload_requested = Signal()
    add_requested = Signal()  # serve it beside the loaded models
    settings_edited = Signal()
    cpu_retry_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._info: ModelInfo | None = None
        self._path: str | None = None
        #: The selected model's path and name as the list has them.
        self._named: tuple[str | None, str] = (None, "")
        self._account = ModelAccount("")

        # --- card
        self.title = heading("No model selected")
        self.title.setWordWrap(True)
        self.subtitle = secondary_label("Pick a model on the left, or open a GGUF file.")
        self.subtitle.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.problem_icon = QLabel()
        self.problem_icon.setPixmap(self.style().standardIcon(
            QStyle.StandardPixmap.SP_MessageBoxWarning).pixmap(20, 20))
        self.problem = QLabel()
        self.problem.setWordWrap(True)
        self.problem.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.problem.setAccessibleName("Model problem")
        problem_row = QHBoxLayout()
        problem_row.addWidget(self.problem_icon, 0, Qt.AlignmentFlag.AlignTop)
        problem_row.addWidget(self.problem, 1)
        self._problem_widgets = (self.problem_icon, self.problem)

        self.facts: dict[str, QLabel] = {}
        # Two columns of three: the facts take three lines, not six.
        facts = QGridLayout()
        facts.setHorizontalSpacing(10)
        facts.setVerticalSpacing(2)
        for index, (key, label) in enumerate((
                ("architecture", "Architecture"), ("size", "File size"),
                ("parameters", "Parameters"), ("context", "Trained context"),
                ("quantization", "Quantization"), ("template", "Chat template"))):
            value = QLabel("—")
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            value.setAccessibleName(label)
            self.facts[key] = value
            row, pair = divmod(index, 2)
            facts.addWidget(secondary_label(label + ":"), row, pair * 2)
            facts.addWidget(value, row, pair * 2 + 1)
        facts.setColumnStretch(1, 1)
        facts.setColumnStretch(3, 1)

        # What a model without a chat template means, beside its card.
        self.template_icon = QLabel()
        self.template_icon.setPixmap(self.style().standardIcon(
            QStyle.StandardPixmap.SP_MessageBoxWarning).pixmap(16, 16))
        self.template_warning = QLabel()
        self.template_warning.setWordWrap(True)
        self.template_warning.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.template_warning.setAccessibleName("Chat template warning")
        template_row_card = QHBoxLayout()
        template_row_card.addWidget(self.template_icon, 0, Qt.AlignmentFlag.AlignTop)
        template_row_card.addWidget(self.template_warning, 1)

        # What the load settings mean: under the card, where there is room for it.
        self.plan = secondary_label("")
        self.plan.setWordWrap(True)
        self.plan.setAccessibleName("What these settings mean")

        card_widget = QWidget()
        card_widget.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        card = QVBoxLayout(card_widget)
        card.setContentsMargins(0, 0, 0, 0)
        card.setSpacing(4)
        card.addWidget(self.title)
        card.addWidget(self.subtitle)
        card.addLayout(problem_row)
        card.addLayout(facts)
        card.addLayout(template_row_card)
        card.addSpacing(4)
        card.addWidget(self.plan)
        card.addStretch(1)

        # --- load settings
        self.ctx_size = _spin(0, 4_194_304, "Model's own", step=1024,
                              tip="Context size in tokens for all parallel slots together: "
                                  "one shared pool with Auto slots, an equal share each with "
                                  "a number of slots. Model's own: each request may use the "
                                  "context the model was trained with (each slot its own with "
                                  "a number of slots), less if the engine must shrink it to fit "
                                  "the memory; with GPU layers None the trained context is "
                                  "shared out instead. The line below says what it means.")
        self.parallel = _spin(0, 256, "Auto",
                              tip="Requests the engine runs at once. Auto lets llama-server decide; "
                                  "the number it chose is shown after loading.")
        self.gpu_layers = _gpu_layers_box()
        self.threads = _spin(0, 1024, "Auto", tip=f"CPU threads; Auto uses {THREADS_HELP}.")
        self.extra_args = QLineEdit()
        self.extra_args.setPlaceholderText("e.g. --flash-attn on --cache-type-k q8_0")
        self.extra_args.setToolTip("More llama-server arguments. The model, host, port, parallel "
                                   "slots, API key and RPC workers are set by GGUF Studio.")
        self.rpc = QLineEdit()
        self.rpc.setPlaceholderText("e.g. 192.168.1.20:50052, 192.168.1.21:50052")
        rpc_tip = ("Spread the model over other machines, each running `gguf-studio "
                   "rpc-worker` (host:port, comma-separated). llama.cpp's RPC has no key and no "
                   "encryption: use it on a trusted wired network only.")
        self.rpc.setToolTip(rpc_tip)
        self.rpc.setAccessibleDescription(rpc_tip)
        self.chat_template = _chat_template_box()
        self.chat_template.currentTextChanged.connect(self.settings_edited)
        self.chat_template.currentTextChanged.connect(lambda _text: self._show_template())
        self.template_file_button = QToolButton()
        self.template_file_button.setText("…")
        self.template_file_button.setToolTip("Pick a Jinja chat template file")
        self.template_file_button.setAccessibleName("Pick a chat template file")
        self.template_file_button.clicked.connect(self._pick_template_file)
        for box in (self.ctx_size, self.parallel, self.threads):
            box.valueChanged.connect(self.settings_edited)
        self.gpu_layers.currentTextChanged.connect(self.settings_edited)
        self.gpu_layers.currentTextChanged.connect(self._show_plan)
        self.extra_args.editingFinished.connect(self.settings_edited)
        self.rpc.editingFinished.connect(self.settings_edited)
        self.memory_plan = secondary_label("")
        self.memory_plan.setAccessibleName("What the layers keep, and the context's memory with "
                                           "these settings")
        self.memory_plan.hide()
        for box in (self.ctx_size, self.parallel):
            box.valueChanged.connect(self._show_plan)
        self.extra_args.editingFinished.connect(self._show_plan)
        self.settings_error = QLabel()
        self.settings_error.setWordWrap(True)
        self.settings_error.setAccessibleName("Load settings problem")
        self.settings_error.hide()
        # Extra arguments and RPC workers are for few: behind "More", open when set.
        self.more_settings = QToolButton()
        self.more_settings.setText("More settings")
        self.more_settings.setCheckable(True)
        self.more_settings.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.more_settings.setArrowType(Qt.ArrowType.RightArrow)
        self.more_settings.setAutoRaise(True)
        self.more_settings.setAccessibleName("More load settings: extra arguments, RPC workers")
        self.more_settings.toggled.connect(self._show_more_settings)

        settings_box = QGroupBox("Load settings")
        form = QFormLayout(settings_box)
        form.setVerticalSpacing(4)
        self._settings_form = form
        context_row = QHBoxLayout()
        context_row.addWidget(self.ctx_size, 1)
        context_row.addWidget(self.memory_plan)
        context_label = QLabel("&Context size:")
        context_label.setBuddy(self.ctx_size)
        form.addRow(context_label, context_row)
        # Slots and threads share a row; so do the GPU layers and the chat template.
        threads_label = QLabel("&Threads:")
        threads_label.setBuddy(self.threads)
        slots_and_threads = QHBoxLayout()
        slots_and_threads.addWidget(self.parallel, 1)
        slots_and_threads.addWidget(threads_label)
        slots_and_threads.addWidget(self.threads, 1)
        slots_label = QLabel("&Parallel slots:")
        slots_label.setBuddy(self.parallel)
        form.addRow(slots_label, slots_and_threads)
        form.addRow("GPU la&yers:", self.gpu_layers)
        template_row = QHBoxLayout()
        template_row.addWidget(self.chat_template, 1)
        template_row.addWidget(self.template_file_button)
        template_label = QLabel("Chat template:")  # every letter of it is taken
        template_label.setBuddy(self.chat_template)
        form.addRow(template_label, template_row)
        form.addRow(self.more_settings)
        form.addRow("E&xtra arguments:", self.extra_args)
        form.addRow("&RPC workers:", self.rpc)
        form.addRow(self.settings_error)
        self._show_more_settings(False)

        # --- load controls
        self.load_button = QPushButton("&Load")
        self.load_button.setDefault(True)
        self.load_button.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_MediaPlay))
        self.load_button.setToolTip("Serve this model. While another model serves, asks first "
                                    "whether to add it beside or replace the default model.")
        self.load_button.clicked.connect(self.load_requested)
        self.unload_button = QPushButton("&Unload")
        self.unload_button.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_MediaStop))
        self.unload_button.setToolTip("Stop serving this model and free its memory.")
        self.unload_button.clicked.connect(self.unload_requested)
        self.add_button = QPushButton("Add &beside")
        self.add_button.setToolTip("Serve this model beside the models already served, with "
                                   "these settings; the default model stays the default.")
        self.add_button.setAccessibleDescription(self.add_button.toolTip())
        self.add_button.clicked.connect(self.add_requested)
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)
        self.progress.setTextVisible(False)
        self.progress.setMaximumWidth(120)
        self.progress.setAccessibleName("Loading")
        self.progress.hide()
        self.slots_icon = QLabel()
        self.slots_icon.setPixmap(self.style().standardIcon(
            QStyle.StandardPixmap.SP_MessageBoxInformation).pixmap(16, 16))
        self.slots_icon.setToolTip("llama-server gave another number of slots than asked for; "
                                   "Details says why.")
        self.slots_icon.hide()
        self.state = QLabel()
        self.state.setWordWrap(True)
        self.state.setAccessibleName("Engine state")
        self.state.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.state.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.details_button = QToolButton()
        self.details_button.setText("Details")
        self.details_button.setCheckable(True)
        self.details_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.details_button.setArrowType(Qt.ArrowType.RightArrow)
        self.details_button.setAutoRaise(True)
        self.details_button.setAccessibleName("The engine's details")
        self.details_button.toggled.connect(self._show_details)
        self.details = QLabel()
        self.details.setWordWrap(True)
        self.details.setAccessibleName("The engine's details")
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.details.hide()
        self.cpu_retry_button = QPushButton("Retry on &CPU")
        self.cpu_retry_button.setToolTip("Load the same model again with no GPU layers.")
        self.cpu_retry_button.clicked.connect(self.cpu_retry_requested)
        self.cpu_retry_button.hide()

        controls = QHBoxLayout()
        controls.addWidget(self.load_button)
        controls.addWidget(self.add_button)
        controls.addWidget(self.unload_button)
        controls.addWidget(self.progress)
        controls.addWidget(self.slots_icon)
        controls.addWidget(self.state, 1)
        controls.addWidget(self.cpu_retry_button)
        controls.addWidget(self.details_button)

        settings_box.setMinimumWidth(340)
        settings_box.setMaximumWidth(460)
        top = QGridLayout()
        top.addWidget(card_widget, 0, 0)
        top.addWidget(settings_box, 0, 1)
        top.setColumnStretch(0, 1)
        top.setColumnMinimumWidth(0, 240)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        layout.addLayout(top)
        layout.addLayout(controls)
        layout.addWidget(self.details)

        self.show_info(None, None)
        self.show_account(ModelAccount("No model selected."))

    # --- card -------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo | None:
        return self._info

    @property
    def path(self) -> str | None:
        return self._path

    def show_reading(self, path: str, name: str) -> None:
        self._path, self._info = path, None
        self._named = (path, name)
        self.title.setText(name)
        self.subtitle.setText(path)
        self._set_problem("")
        for value in self.facts.values():
            value.setText("…")
        self._update_buttons()

    def show_info(self, path: str | None, info: ModelInfo | None, problem: str = "") -> None:
        """The card for `path`: its metadata, or `problem` when it cannot be read."""
        self._path, self._info = path, info
        if info is not None:
            # The name the list shows (the file's); the one inside the file is its hover.
            listed_path, listed_name = self._named
            self.title.setText(listed_name if path == listed_path else info.name)
            self.title.setToolTip(plain_tooltip(f"Named in the file: {info.name}"))
            self.subtitle.setText(info.path)
            self.facts["architecture"].setText(info.architecture)
            self.facts["parameters"].setText(format_parameter_count(info.parameter_count))
            self.facts["quantization"].setText(info.file_type)
            self.facts["size"].setText(format_file_size(info.file_size))
            self.facts["context"].setText(f"{info.context_length:,} tokens" if info.context_length
                                          else "unknown")

        else:
            if path is None:
                self.title.setText("No model selected")
                self.subtitle.setText("Pick a model on the left, or open a GGUF file.")
            else:
                self.subtitle.setText(path)
            for value in self.facts.values():
                value.setText("—")
        self._set_problem(problem)
        self._show_template()
        self._show_plan()
        self._update_buttons()

    def _set_problem(self, text: str) -> None:
        self.problem.setText(text)
        for widget in self._problem_widgets:
            widget.setVisible(bool(text))

    # --- load settings ----------------------------------------------------------------------

    def load_settings(self) -> LoadSettings:
        """What the fields say; raises SettingsError for unreadable extra arguments or
        RPC workers."""
        return LoadSettings(
            ctx_size=self.ctx_size.value(),
            parallel=str(self.parallel.value()) if self.parallel.value() else "auto",
            n_gpu_layers=_gpu_layers_value(self.gpu_layers), threads=self.threads.value(),
            extra_args=LoadSettings.parse_extra_args(self.extra_args.text()),
            rpc=parse_rpc_workers(self.rpc.text()),
            chat_template=_chat_template_value(self.chat_template))

    def set_load_settings(self, settings: LoadSettings) -> None:
        fields = (self.ctx_size, self.parallel, self.gpu_layers, self.threads, self.extra_args,
                  self.rpc, self.chat_template)
        for field in fields:
            field.blockSignals(True)
        self.ctx_size.setValue(settings.ctx_size)
        self.parallel.setValue(int(settings.parallel) if str(settings.parallel).isdigit() else 0)
        _show_gpu_layers(self.gpu_layers, settings.n_gpu_layers)
        self.threads.setValue(settings.threads)
        self.extra_args.setText(shlex.join(settings.extra_args))
        self.rpc.setText(", ".join(settings.rpc))
        if settings.extra_args or settings.rpc:
            self.more_settings.setChecked(True)
        _show_chat_template(self.chat_template, settings.chat_template)
        for field in fields:
            field.blockSignals(False)
        self.show_settings_error("")
        self._show_template()
        self._show_plan()

    def show_settings_error(self, message: str) -> None:
        self.settings_error.setText(message)
        self.settings_error.setVisible(bool(message))

    # --- state ------------------------------------------------------------------------------

    def show_load_failed(self, message: str) -> None:
        """A load that failed before the engine ever started (no engine, for instance)."""
        self.state.setText(f"Failed — {message}")

    def show_account(self, account: ModelAccount, *, cpu_retry: bool = False) -> None:
        """The selected model's own engine, as `backend.app.model_account` words it;
        `cpu_retry`: its GPU load failed and the same load on the CPU may work."""
        self._account = account
        self.progress.setVisible(account.busy)
        self.state.setText(account.headline)
        self.slots_icon.setVisible(account.slots_differ)
        self.details.setText("\n".join(account.details))
        self.details_button.setEnabled(bool(account.details))
        self._show_details(self.details_button.isChecked())
        self.cpu_retry_button.setVisible(cpu_retry)
        self._update_buttons()

    def _show_details(self, shown: bool) -> None:
        self.details_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        self.details.setVisible(shown and bool(self._account.details))

    def _show_more_settings(self, shown: bool) -> None:
        self.more_settings.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        for field in (self.extra_args, self.rpc):
            self._settings_form.setRowVisible(field, shown)

    def _show_template(self) -> None:
        """The card's chat template as the model and the template picked make it, and
        what having none means for its clients."""
        info = self._info
        template = ChatTemplate.of(_chat_template_value(self.chat_template),
                                   model_has_one=info.has_chat_template) if info is not None else None
        if template is not None:
            self.facts["template"].setText(template.describe())
        warning = template.warning() if template is not None else ""
        self.template_warning.setText(warning)
        for widget in (self.template_icon, self.template_warning):
            widget.setVisible(bool(warning))

    def _pick_template_file(self) -> None:
        path, _filter = QFileDialog.getOpenFileName(
            self, "Chat template file", "", "Jinja templates (*.jinja *.j2 *.txt);;All files (*)")
        if path:
            self.chat_template.setCurrentText(path)

    def _show_plan(self) -> None:
        try:
            settings = self.load_settings()
        except SettingsError:  # unreadable extra arguments or workers: the settings error says so
            self.plan.setText("")
            self.memory_plan.setText("")
            self.memory_plan.hide()
            return
        trained = self._info.context_length if self._info is not None else None
        self.plan.setText(settings.describe_plan(trained))
        self._show_memory(settings)

    def _show_memory(self, settings: LoadSettings) -> None:
        """Beside the context: what the KV cache and state take with these settings; the
        hover says what each kind of layer keeps and where the bytes go."""
        info = self._info
        memory = load_memory(info, settings) if info is not None else None
        if info is None or info.memory is None or memory is None:
            self.memory_plan.setText("")
            self.memory_plan.hide()
            return
        kind = "KV cache and state" if info.memory.recurrent_layers else "KV cache"
        self.memory_plan.setText(f"{kind} {format_memory(memory.total_bytes)}")
        tip = info.memory.describe()
        self.memory_plan.setToolTip(f"{tip[:1].upper()}{tip[1:]}. {memory.describe()}.")
        self.memory_plan.setAccessibleDescription(self.memory_plan.toolTip())
        self.memory_plan.show()

    def _update_buttons(self) -> None:
        self.load_button.setEnabled(self._info is not None)
        self.add_button.setEnabled(self._info is not None)
        self.unload_button.setEnabled(self._account.loaded)


def describe_state(snapshot: Snapshot) -> str:
    name = snapshot.model_id or "the model"
    if snapshot.state is State.READY:
        return f"Ready — {name}"
    if snapshot.state is State.STARTING:
        if snapshot.restarting:
            return f"Restarting — {snapshot.error or 'llama-server stopped unexpectedly.'}"
        return f"Starting — loading {name}…"
    if snapshot.state is State.STOPPING:
        return "Stopping…"
    if snapshot.state is State.FAILED:
        return f"Failed — {snapshot.error or 'the model did not load.'}"
    return "Stopped — no model loaded"


_GPU_LAYER_LABELS = {"auto": "Automatic (what fits)", "all": "All", "none": "None (CPU only)"}


def _gpu_layers_box() -> QComboBox:
    """Automatic / All / None, or a typed number of layers."""
    box = QComboBox()
    box.setEditable(True)
    box.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
    for value, label in _GPU_LAYER_LABELS.items():
        box.addItem(label, value)
    tip = ("Layers to put on the GPU. Automatic offloads what fits in the GPU's free memory "
           "and may shrink a context left at \"Model's own\" to fit; type a number for exactly "
           "that many layers.")
    box.setToolTip(tip)
    box.setAccessibleDescription(tip)
    return box


def _gpu_layers_value(box: QComboBox) -> str:
    """The setting the box shows; SettingsError for text that is not one."""
    text = box.currentText().strip()
    for value, label in _GPU_LAYER_LABELS.items():
        if text == label:
            return value
    return parse_gpu_layers(text)


def _show_gpu_layers(box: QComboBox, value: str) -> None:
    value = parse_gpu_layers(value)
    box.setCurrentText(_GPU_LAYER_LABELS.get(value, value))


_TEMPLATE_LABELS = {OWN_TEMPLATE: "Model's own", NO_TEMPLATE: "None (plain completion only)"}


def _chat_template_box() -> QComboBox:
    """The model's own, none, llama.cpp's built-in templates, or a typed or picked file."""
    box = QComboBox()
    box.setEditable(True)
    box.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
    for value, label in _TEMPLATE_LABELS.items():
        box.addItem(label, value)
    box.insertSeparator(box.count())
    for name in BUILT_IN_TEMPLATES:
        box.addItem(name, name)
    tip = ("The chat template chats are rendered with. Model's own: the one in its GGUF file; a "
           "model without one takes no chats (plain completion only) until one is picked here: "
           "one of llama.cpp's built-in templates (chatml also takes tools), or a Jinja file "
           "(…), which takes tools. Applies at the next load.")
    box.setToolTip(tip)
    box.setAccessibleDescription(tip)
    return box


def _chat_template_value(box: QComboBox) -> str:
    """The pick the box shows: a label's value, else the name or file typed."""
    text = box.currentText().strip()
    for value, label in _TEMPLATE_LABELS.items():
        if text == label:
            return value
    return text


def _show_chat_template(box: QComboBox, value: str) -> None:
    box.setCurrentText(_TEMPLATE_LABELS.get(value, value))


def _spin(low: int, high: int, special: str, *, step: int = 1, tip: str = "") -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setSpecialValueText(special)
    box.setGroupSeparatorShown(True)
    box.setToolTip(tip)
    box.setAccessibleDescription(tip)
    return box
