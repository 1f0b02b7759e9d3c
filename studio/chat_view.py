"""The Chat tab: talk to a model of the pool the way an agent does, through the port.

`ChatView` renders a conversation (`backend.app.chat_session.ChatState`) and emits what
the person asks for; `ChatLink` runs the conversation (`ChatSession`) on the bridge's
backend loop, where all of the window's network I/O happens, and brings its state back to
the GUI thread at most twenty times a second, so a fast stream costs the window a few
repaints a second and the window never waits on the network.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable, Collection, Coroutine

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGridLayout,
    QHBoxLayout,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from backend.app.chat_session import AnswerState, ChatOptions, ChatSession, ChatState
from backend.throttle import Throttle
from studio.bridge import ServiceBridge
from studio.chat_transcript import Transcript
from studio.widgets import secondary_label

__all__ = ["STATE_INTERVAL", "STREAM_DRAW_SHARE", "ChatLink", "ChatView"]

#: The conversation reaches the window at most this often while an answer streams.
STATE_INTERVAL = 0.05
#: The share of the window's time an answer's redraws may take while it streams: after
#: a redraw that took t seconds, the next that only adds to the streaming answer waits
#: 3 t (and shows the newest state then).
STREAM_DRAW_SHARE = 0.25
#: How often the "answering…" clock under the conversation moves.
CLOCK_INTERVAL_MS = 100
log = logging.getLogger("gguf_studio.studio")


class ChatView(QWidget):
    send_requested = Signal(str, object)  # the person's text, ChatOptions
    stop_requested = Signal()
    regenerate_requested = Signal(object)  # ChatOptions
    clear_requested = Signal()
    undo_clear_requested = Signal()
    share_requested = Signal()  # the next step after a chat: share the model

    def __init__(self, parent: QWidget | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(parent)
        self._clock = clock
        self.state = ChatState()
        self._answer_started: float | None = None
        #: The models served without a chat template: plain completion only.
        self._without_template: frozenset[str] = frozenset()
        #: The model chosen in the library, named while nothing is loaded.
        self._chosen = ""
        #: The model to choose once the port lists it ("": none).
        self._wanted = ""
        #: The models with an engine ready now; the others load on the first message.
        self._ready: frozenset[str] = frozenset()
        #: Plain completion as the person chose it for models that take chats.
        self._plain_chosen = False

        self.model = QComboBox()
        self.model.setAccessibleName("Model to chat with")
        self.model.setMinimumContentsLength(24)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(0.7)
        self.temperature.setAccessibleName("Temperature")
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 1_000_000)
        self.max_tokens.setValue(1024)
        self.max_tokens.setAccessibleName("Most tokens of an answer")
        self.plain = QCheckBox("Plain &completion")
        self.plain.setToolTip("Send the conversation as one text to /v1/completions: the model "
                              "continues it, without a chat template. A model that has none "
                              "takes only this.")
        self.plain.setAccessibleDescription(self.plain.toolTip())
        self.plain.toggled.connect(self._plain_toggled)
        self.model.currentTextChanged.connect(lambda _name: self._show_mode())
        # Another model is another conversation: the shown one is set aside (Undo clear).
        self.model.textActivated.connect(lambda _name: self.clear_requested.emit()
                                         if self.state.turns else None)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt (optional)")
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setTabChangesFocus(True)
        self.system_prompt.setFixedHeight(self.system_prompt.fontMetrics().lineSpacing() * 3 + 12)

        self.transcript = Transcript()
        self.transcript.setAccessibleName("Conversation")
        self.status = secondary_label("")
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # The next step once a model answers here: let teammates and their agents use it.
        self.share_button = QPushButton("Share it with your team…")
        self.share_button.setToolTip("The Sharing tab: open the port on the network, make "
                                     "keys, and copy the set-up for Codex, OpenCode or curl.")
        self.share_button.clicked.connect(self.share_requested.emit)
        self._shared = False

        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message — Enter sends, Shift+Enter starts a new line")
        self.input.setAccessibleName("Message")
        self.input.setTabChangesFocus(True)
        self.input.setFixedHeight(self.input.fontMetrics().lineSpacing() * 4 + 12)
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self.input, self.send,
                      context=Qt.ShortcutContext.WidgetShortcut)
        # Enter sends, as in every chat; Shift+Enter is a new line.
        self.input.installEventFilter(self)
        self.send_button = QPushButton("Se&nd")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the answer, keeping what arrived (Esc)")
        self.stop_button.clicked.connect(self.stop_requested.emit)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, self._stop,
                  context=Qt.ShortcutContext.WidgetWithChildrenShortcut)
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setToolTip("Drop the last answer and ask again")
        self.regenerate_button.clicked.connect(
            lambda: self.regenerate_requested.emit(self.options()))
        self.clear_button = QPushButton("Clear")
        self.clear_button.setToolTip("Start a new conversation (Undo brings this one back)")
        self.clear_button.clicked.connect(self._clear_or_undo)

        # The elapsed time of the answer on its way, so a slow first token is seen waiting.
        self._draw_after = 0.0
        self._draw_timer = QTimer(self)
        self._draw_timer.setSingleShot(True)
        self._draw_timer.timeout.connect(self._draw)
        self.clock = QTimer(self)
        self.clock.setInterval(CLOCK_INTERVAL_MS)
        self.clock.timeout.connect(self._show_status)

        settings = QHBoxLayout()
        form = QFormLayout()
        form.addRow("Model", self.model)
        form.addRow("", self.plain)
        settings.addLayout(form, 2)
        numbers = QFormLayout()
        numbers.addRow("Temperature", self.temperature)
        numbers.addRow("Max to&kens", self.max_tokens)
        settings.addLayout(numbers, 1)
        buttons = QGridLayout()
        buttons.addWidget(self.send_button, 0, 0)
        buttons.addWidget(self.stop_button, 0, 1)
        buttons.addWidget(self.regenerate_button, 1, 0)
        buttons.addWidget(self.clear_button, 1, 1)
        entry = QHBoxLayout()
        entry.addWidget(self.input, 1)
        entry.addLayout(buttons)
        layout = QVBoxLayout(self)
        layout.addLayout(settings)
        layout.addWidget(self.system_prompt)
        layout.addWidget(self.transcript, 1)
        status_row = QHBoxLayout()
        status_row.addWidget(self.status, 1)
        status_row.addWidget(self.share_button)
        layout.addLayout(status_row)
        layout.addLayout(entry)
        self.show_state(self.state)

    # --- what the window tells ----------------------------------------------------------

    def set_chosen(self, name: str) -> None:
        """The model chosen in the library (empty: none), named while nothing is loaded."""
        self._chosen = name
        self._show_status()

    def set_models(self, names: list[str], without_template: Collection[str] = (),
                   ready: Collection[str] | None = None) -> None:
        """The models the port serves now, those of them without a chat template (plain
        completion only) and those ready now (None: all); the one chosen stays chosen
        while served."""
        self._without_template = frozenset(without_template)
        self._ready = frozenset(names if ready is None else ready)
        current = self.model.currentText()
        if self._wanted in names:  # the model just loaded, once listed
            current, self._wanted = self._wanted, ""
        if names != [self.model.itemText(i) for i in range(self.model.count())]:
            self.model.blockSignals(True)
            self.model.clear()
            self.model.addItems(names)
            self.model.blockSignals(False)
        if current in names and current != self.model.currentText():
            self.model.setCurrentText(current)
        self._show_mode()

    def set_shared(self, shared: bool) -> None:
        """Whether the port is shared on the network (then Share is no next step)."""
        self._shared = shared
        self._enable()

    def choose(self, name: str) -> None:
        """Chat with `name` (once the port lists it); a conversation with another model
        is set aside (Undo clear brings it back)."""
        if name != self.model.currentText() and self.state.turns:
            self.clear_requested.emit()
        self._wanted = name
        if self.model.findText(name) >= 0:
            self.model.setCurrentText(name)

    def show_state(self, state: ChatState) -> None:
        was_streaming = self.state.streaming
        self.state = state
        if state.streaming and not was_streaming:
            self._answer_started = time.monotonic()
            self.clock.start()
        elif not state.streaming:
            self.clock.stop()
            self._answer_started = None
        if self._clock() < self._draw_after and self.transcript.only_grows(state.turns):
            if not self._draw_timer.isActive():  # the newest state is drawn then
                self._draw_timer.start(max(1, round((self._draw_after - self._clock()) * 1000)))
        else:
            self._draw()
        self._show_status()
        self._enable()

    def _draw(self) -> None:
        """The conversation as the state has it; a slow redraw spaces the next ones while
        an answer streams (on a long answer in many scripts it took tens of ms)."""
        self._draw_timer.stop()
        began = self._clock()
        self.transcript.show_turns(self.state.turns)
        took = self._clock() - began
        self._draw_after = began + took / STREAM_DRAW_SHARE

    # --- what the person does ------------------------------------------------------------

    def options(self) -> ChatOptions:
        return ChatOptions(model=self.model.currentText(),
                           system_prompt=self.system_prompt.toPlainText(),
                           temperature=round(self.temperature.value(), 2),
                           max_tokens=self.max_tokens.value(),
                           completion=self.plain.isChecked())

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or not self.send_button.isEnabled():
            return
        self.input.clear()
        self.send_button.setEnabled(False)  # until the state says the answer ended
        self.send_requested.emit(text, self.options())

    # --- helpers -----------------------------------------------------------------------------

    def _plain_toggled(self, checked: bool) -> None:
        if self.plain.isEnabled():  # the person's choice, not a model's lack of a template
            self._plain_chosen = checked
        self._show_mode()

    def _show_mode(self) -> None:
        """Plain completion forced for a model without a chat template, else as chosen."""
        forced = self.model.currentText() in self._without_template
        self.plain.blockSignals(True)
        self.plain.setChecked(forced or self._plain_chosen)
        self.plain.setEnabled(not forced)
        self.plain.blockSignals(False)
        plain = self.plain.isChecked()
        self.system_prompt.setEnabled(not plain)
        self.input.setPlaceholderText(
            "Text for the model to continue — Enter sends, Shift+Enter starts a new line"
            if plain else "Message — Enter sends, Shift+Enter starts a new line")
        self._show_status()
        self._enable()

    def _stop(self) -> None:
        if self.stop_button.isEnabled():
            self.stop_requested.emit()

    def _show_status(self) -> None:
        turns = self.state.turns
        last = turns[-1] if turns and turns[-1].role == "assistant" else None
        current = self.model.currentText()
        if not self.model.count() and self._chosen:
            self.status.setText(f"No model is loaded yet: press Load above to chat with "
                                f"{self._chosen}, or pick another in the list on the left.")
        elif not self.model.count():
            self.status.setText("No model is loaded yet: pick one in the list on the left and "
                                "press Load to chat with it.")
        elif self.state.streaming and self._answer_started is not None:
            waited = time.monotonic() - self._answer_started
            doing = "Waiting for the first token" if last is None or not last.text else "Answering"
            self.status.setText(f"{doing}… {waited:.1f} s")
        elif last is not None and last.state is AnswerState.FAILED:
            self.status.setText(last.error)
        elif current in self._without_template:
            self.status.setText(f"{self.model.currentText()} has no chat template, so it takes no "
                                "chats: plain completion, the model continues your text. Pick a "
                                "chat template in its load settings to chat.")
        elif current not in self._ready:
            self.status.setText(f"{current} is not loaded right now: a message waits while it "
                                "loads.")
        elif self.plain.isChecked():
            self.status.setText("Plain completion: the model continues the text, through the "
                                "port with the owner's key.")
        else:
            self.status.setText("Through the port with the owner's key, as an agent's request goes.")

    def _enable(self) -> None:
        streaming = self.state.streaming
        has_model = self.model.count() > 0
        self.send_button.setEnabled(has_model and not streaming)
        self.stop_button.setEnabled(streaming)
        self.regenerate_button.setEnabled(has_model and self.state.can_regenerate)
        undo = self.state.can_undo_clear
        self.clear_button.setText("Undo clear" if undo else "Clear")
        self.share_button.setVisible(not self._shared and bool(self._ready))
        self.clear_button.setEnabled(bool(self.state.turns) or undo)

    def _clear_or_undo(self) -> None:
        if self.state.can_undo_clear and not self.state.turns:
            self.undo_clear_requested.emit()
        else:
            self.clear_requested.emit()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.input and event.type() == QEvent.Type.KeyPress \
                and isinstance(event, QKeyEvent) \
                and event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) \
                and not event.modifiers() & (Qt.KeyboardModifier.ShiftModifier
                                             | Qt.KeyboardModifier.ControlModifier):
            self.send()
            return True
        return super().eventFilter(watched, event)


class ChatLink(QObject):
    """Runs `view`'s conversation on `bridge`'s backend loop and shows its state."""

    state_changed = Signal(object)  # ChatState, emitted from the backend loop

    def __init__(self, bridge: ServiceBridge, view: ChatView) -> None:
        super().__init__(view)
        self._bridge = bridge
        loop = bridge.backend_thread.loop

        def later(delay: float, fn: Callable[[], None]) -> None:
            loop.call_later(delay, fn)  # pokes come from the session, on that loop

        self._throttle = Throttle(STATE_INTERVAL, self._publish, later)
        self.session = ChatSession.of_service(bridge.service, on_change=self._throttle.poke)
        self.state_changed.connect(view.show_state)
        view.send_requested.connect(lambda text, options: self._run(self.session.send(text, options)))
        view.stop_requested.connect(lambda: self._run(self.session.stop()))
        view.regenerate_requested.connect(lambda options: self._run(self.session.regenerate(options)))
        view.clear_requested.connect(lambda: self._run(self.session.clear()))
        view.undo_clear_requested.connect(lambda: self._run(self.session.undo_clear()))

    def close(self, timeout: float = 5.0) -> None:
        """Stop an answer on its way (before the port closes, so it need not wait for it)."""
        if self._bridge.closed:
            return
        try:
            self._bridge.backend_thread.submit(self.session.stop()).result(timeout)
        except Exception:
            log.exception("the chat did not stop")

    def _run(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self._bridge.closed:
            coro.close()
            return
        self._bridge.backend_thread.submit(coro).add_done_callback(_log_failure)

    def _publish(self) -> None:  # on the backend loop
        try:
            self.state_changed.emit(self.session.state)
        except RuntimeError:  # the window is gone: the app is exiting
            pass


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("the chat failed", exc_info=future.exception())
