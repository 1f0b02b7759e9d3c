"""The Chat tab with the real SmolLM2 behind the window's own port: an answer streams
(the window stays responsive meanwhile), stops on request keeping what arrived, shows
real figures, regenerates and clears; Markdown code blocks read as code."""

from __future__ import annotations

import re
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, Qt, QTimer
from PySide6.QtGui import QFont, QFontMetricsF
from PySide6.QtWidgets import QApplication

from backend.app.chat_session import AnswerFigures, AnswerState, ChatState, Turn
from backend.llama.load import State
from studio.chat_view import ChatView
from studio.window import CHAT_TAB, MainWindow
from tests.studio.test_pool_view import LOAD_WAIT, SMOL_ARGS, WAIT, select, until

STORY = "Write a very long story about a dragon who learns to cook. Use many chapters."
QUESTION = "What is the capital of France? Answer in one sentence."


def monospaced(font: QFont) -> bool:
    """Whether `font`, as this machine's fonts resolve it, gives every glyph one width.
    (Qt's `QFontInfo.fixedPitch()` is not it: fontconfig's monospace is Noto Sans Mono on
    Debian desktops with fonts-noto-mono, which Qt does not flag fixed-pitch.)"""
    metrics = QFontMetricsF(font)
    return len({metrics.horizontalAdvance(glyph) for glyph in "iW.m0_"}) == 1


def last_answer(window: MainWindow) -> Turn | None:
    turns = window.chat.state.turns
    return turns[-1] if turns and turns[-1].role == "assistant" else None


def answered(window: MainWindow, state: AnswerState) -> bool:
    answer = last_answer(window)
    return answer is not None and answer.state is state and not window.chat.state.streaming


def send(qtbot, window: MainWindow, text: str) -> None:
    window.chat.input.setPlainText(text)
    qtbot.mouseClick(window.chat.send_button, Qt.MouseButton.LeftButton)


def test_the_chat_tab_streams_stops_regenerates_and_clears_with_smollm2(
        open_window, qtbot, with_engine: Path, smollm2_model: Path) -> None:
    window = open_window()
    window.open_files([str(smollm2_model)])
    select(qtbot, window, smollm2_model)
    window.model_view.ctx_size.setValue(4096)
    window.model_view.extra_args.setText(SMOL_ARGS)
    window.load_selected()
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    # Shared on the LAN, the port wants a key: the chat sends the owner's, as a client would.
    qtbot.waitUntil(lambda: bool(window.bridge.urls), timeout=WAIT)
    with qtbot.waitSignal(window.bridge.urls_changed, timeout=WAIT):  # reopened
        window.sharing.lan.click()
    assert window.bridge.service.settings.api_key
    chat = window.chat
    window.tabs.setCurrentIndex(CHAT_TAB)
    qtbot.waitUntil(lambda: chat.model.count() == 1 and chat.send_button.isEnabled(), timeout=WAIT)
    assert chat.plain.isEnabled() and not chat.plain.isChecked()  # it has a chat template
    chat.max_tokens.setValue(3000)

    # A long answer streams into the conversation ...
    send(qtbot, window, STORY)
    until(qtbot, lambda: chat.state.streaming and len(chat.transcript.toPlainText()) > len(STORY) + 60,
          lambda: (chat.state, chat.status.text()), timeout=60_000)
    assert chat.stop_button.isEnabled() and not chat.send_button.isEnabled()
    # ... while the window goes on: a timer of its own fires, the tab's clock moves.
    shown = chat.status.text()
    assert re.match(r"Answering… \d+\.\d s", shown), shown
    probe = QTimer()
    probe.setSingleShot(True)
    with qtbot.waitSignal(probe.timeout, timeout=2000):
        probe.start(20)
    qtbot.waitUntil(lambda: chat.status.text() != shown, timeout=2000)
    assert chat.state.streaming  # all of that happened during the stream

    # Stop: the answer ends where it was, what arrived stays on screen.
    qtbot.mouseClick(chat.stop_button, Qt.MouseButton.LeftButton)
    until(qtbot, lambda: answered(window, AnswerState.STOPPED), lambda: chat.state, timeout=WAIT)
    stopped = last_answer(window)
    assert stopped is not None and len(stopped.text) > 20
    assert stopped.figures is not None and 0 < stopped.figures.output_tokens < 3000
    assert "Stopped" in chat.transcript.toPlainText()
    assert stopped.text.split()[-1] in chat.transcript.toPlainText()
    assert chat.send_button.isEnabled() and not chat.stop_button.isEnabled()
    qtbot.waitUntil(lambda: window.bridge.requests_in_flight() == 0, timeout=WAIT)

    # A short answer to the end, with its real figures under it.
    chat.max_tokens.setValue(64)
    send(qtbot, window, QUESTION)
    until(qtbot, lambda: answered(window, AnswerState.DONE), lambda: chat.state, timeout=60_000)
    answer = last_answer(window)
    assert answer is not None and answer.figures is not None
    # Each answer's figures, the stopped one's too (what the cache held survives a stop).
    shown_figures = re.findall(r"first token (\d+\.\d+) s · (\d+\.\d) tok/s · (\d+) tokens · "
                               r"(\d+) of (\d+) prompt tokens cached", chat.transcript.toPlainText())
    assert len(shown_figures) == 2, chat.transcript.toPlainText()
    ttft, speed, tokens, cached, prompt = shown_figures[-1]
    assert float(ttft) > 0 and float(speed) > 0 and int(tokens) > 1
    # The conversation's earlier turns were kept in the engine's cache.
    assert 0 < int(cached) <= int(prompt)
    assert f"{answer.figures.tokens_per_second:.1f}" == speed

    # Regenerate replaces that answer; Clear empties the tab.
    qtbot.mouseClick(chat.regenerate_button, Qt.MouseButton.LeftButton)
    until(qtbot, lambda: last_answer(window) is not answer and answered(window, AnswerState.DONE),
          lambda: chat.state, timeout=60_000)
    assert [turn.role for turn in chat.state.turns] == ["user", "assistant"] * 2
    qtbot.mouseClick(chat.clear_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: chat.state.turns == () and not chat.transcript.toPlainText().strip(),
                    timeout=WAIT)


def test_code_blocks_read_as_code_and_an_unfinished_one_keeps_to_its_answer(qtbot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    code = "def add(a, b):\n    return a + b"
    view.show_state(ChatState((
        Turn("user", "Show me *code*"),
        Turn("assistant", f"Here:\n\n```python\n{code}\n```\n\nDone.", model="smol",
             figures=AnswerFigures(0.25, 41.5, 12, 30, 0)),
        Turn("user", "More"),
        Turn("assistant", "```python\nprint(1)", AnswerState.STOPPED, model="smol"),
        Turn("user", "After"),
    )))

    text = view.transcript.toPlainText()
    assert "Show me code" in text and "```" not in text  # Markdown, not its marks
    assert "first token 0.25 s · 41.5 tok/s · 12 tokens · 0 of 30 prompt tokens cached" in text
    document = view.transcript.document()
    found = document.find("return a + b")
    assert not found.isNull()
    assert monospaced(found.charFormat().font())
    assert found.block().blockFormat().background().style() != Qt.BrushStyle.NoBrush
    done = document.find("Done.")
    assert not monospaced(done.charFormat().font())
    # The stopped answer's open fence ends with it: the next turn is no code.
    after = document.find("After")
    assert not after.isNull()
    assert after.block().blockFormat().background().style() == Qt.BrushStyle.NoBrush
    assert not monospaced(after.charFormat().font())
    assert "Stopped" in text


def test_a_code_block_has_a_copy_link_that_copies_its_code(qtbot) -> None:
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    view = ChatView()
    qtbot.addWidget(view)
    code = "def add(a, b):\n    return a + b"
    view.show_state(ChatState((
        Turn("user", "Code please"),
        Turn("assistant", f"Here:\n\n```python\n{code}\n```\n\nand\n\n```\nls -l\n```", model="smol"),
    )))
    assert view.transcript.toPlainText().count("Copy code") == 2
    QGuiApplication.clipboard().clear()
    view.transcript.anchorClicked.emit(QUrl("copy:1:0"))
    assert QGuiApplication.clipboard().text() == code
    view.transcript.anchorClicked.emit(QUrl("copy:1:1"))
    assert QGuiApplication.clipboard().text() == "ls -l"


def test_enter_sends_shift_enter_starts_a_new_line_and_clear_can_be_undone(qtbot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    view.set_models(["smol"])
    sent: list[str] = []
    view.send_requested.connect(lambda text, _options: sent.append(text))
    qtbot.keyClicks(view.input, "first line")
    qtbot.keyClick(view.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(view.input, "second")
    assert sent == [] and view.input.toPlainText() == "first line\nsecond"
    qtbot.keyClick(view.input, Qt.Key.Key_Return)
    assert sent == ["first line\nsecond"] and view.input.toPlainText() == ""

    cleared, undone = [], []
    view.clear_requested.connect(lambda: cleared.append(1))
    view.undo_clear_requested.connect(lambda: undone.append(1))
    view.show_state(ChatState((Turn("user", "hi"), Turn("assistant", "hello", model="smol"))))
    view.clear_button.click()
    assert cleared == [1]
    view.show_state(ChatState(can_undo_clear=True))  # as the session says after a clear
    assert view.clear_button.text() == "Undo clear" and view.clear_button.isEnabled()
    view.clear_button.click()
    assert undone == [1]


def test_the_chat_offers_sharing_as_the_next_step(qtbot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    view.show()
    assert not view.share_button.isVisible()  # nothing to share yet
    view.set_models(["smol"], ready=["smol"])
    assert view.share_button.isVisible()
    asked = []
    view.share_requested.connect(lambda: asked.append(1))
    view.share_button.click()
    assert asked == [1]
    view.set_shared(True)
    assert not view.share_button.isVisible()


def test_a_streaming_answer_redraws_itself_alone_and_the_conversation_stays_right(qtbot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    earlier = tuple(turn for i in range(30) for turn in (
        Turn("user", f"Question {i}?"),
        Turn("assistant", f"Answer {i} with `code`.\n\n```\nx = {i}\n```", model="smol")))
    question = Turn("user", "Last question?")
    view.show_state(ChatState(earlier))
    document = view.transcript.document()
    document.firstBlock().setUserState(7)  # gone if the document is built again
    view.show_state(ChatState(earlier + (question, Turn("assistant", "", AnswerState.WAITING)), True))

    for text in ("The", "The answer", "The answer is **42**."):
        view.show_state(ChatState(earlier + (question, Turn("assistant", text, AnswerState.STREAMING,
                                                              model="smol")), True))
    done = Turn("assistant", "The answer is **42**.", model="smol",
                figures=AnswerFigures(0.5, 20.0, 6, 200, 190))
    view.show_state(ChatState(earlier + (question, done)))

    assert document.firstBlock().userState() == 7
    text = view.transcript.toPlainText()
    assert text.count("Last question?") == 1 and text.count("The answer") == 1
    assert text.endswith("The answer is 42.\nfirst token 0.50 s · 20.0 tok/s · 6 tokens · "
                         "190 of 200 prompt tokens cached")
    assert monospaced(document.find("x = 29").charFormat().font())
    # Regenerate drops the answer, Clear everything: what is shown follows.
    view.show_state(ChatState(earlier + (question,), True))
    assert view.transcript.toPlainText().endswith("Last question?")
    view.show_state(ChatState())
    assert not view.transcript.toPlainText().strip()


def test_the_chat_tab_offers_plain_completion_for_a_model_without_a_chat_template(
        open_window, qtbot, with_engine: Path, gemma3_model: Path) -> None:
    """Gemma 3 270M has no chat template: the tab says so, sends through /v1/completions
    only (its chats would be refused), and the model's continuation streams in."""
    window = open_window()
    window.open_files([str(gemma3_model)])
    select(qtbot, window, gemma3_model)
    window.model_view.ctx_size.setValue(2048)
    window.model_view.parallel.setValue(1)
    window.load_selected()
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    chat = window.chat
    window.tabs.setCurrentIndex(CHAT_TAB)
    qtbot.waitUntil(lambda: chat.model.count() == 1 and not chat.plain.isEnabled(), timeout=WAIT)
    name = chat.model.currentText()
    assert chat.plain.isChecked()  # the only way it takes text
    assert chat.status.text().startswith(f"{name} has no chat template, so it takes no chats")
    assert not chat.system_prompt.isEnabled()
    assert chat.input.placeholderText().startswith("Text for the model to continue")
    chat.max_tokens.setValue(12)
    chat.temperature.setValue(0.0)

    send(qtbot, window, "The capital of France is")
    until(qtbot, lambda: answered(window, AnswerState.DONE), lambda: chat.state, timeout=60_000)
    answer = last_answer(window)
    assert answer is not None and answer.text.strip() and answer.figures is not None
    assert answer.figures.output_tokens > 1
    assert answer.text.strip().split()[0] in chat.transcript.toPlainText()
    # It went to the completions route, as the inspector's record says.
    records = window.bridge.service.requests.records()
    assert records[-1].route == "/v1/completions" and records[-1].status == 200


def test_a_long_streaming_answer_is_redone_by_the_paragraph_being_written_alone(qtbot) -> None:
    """Each update writes the paragraphs settled since and the one being written, not the
    whole answer again (the window's loop re-read the whole answer's Markdown twenty times
    a second); what is shown at the end is the answer as written whole."""
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    from studio.chat_transcript import Transcript

    paragraphs = [f"Paragraph {n}: the keeper climbed the *stairs* again, " + "and the wind " * 8
                  for n in range(40)]
    paragraphs[20] = "```python\nprint('the storm')\n\nprint('passed')\n```"  # a blank line inside
    answer = "\n\n".join(paragraphs)
    question = Turn("user", "A long story, please")
    transcript = Transcript()
    qtbot.addWidget(transcript)
    added: list[int] = []
    transcript.document().contentsChange.connect(lambda _at, _removed, n: added.append(n))
    transcript.show_turns((question, Turn("assistant", "", AnswerState.WAITING)))
    biggest = 0
    for end in range(23, len(answer), 23):
        added.clear()
        transcript.show_turns((question, Turn("assistant", answer[:end], AnswerState.STREAMING,
                                              model="smol")))
        biggest = max(biggest, sum(added))
    longest = max(len(p) for p in paragraphs)
    assert len(answer) > 10 * longest
    assert biggest <= 2 * longest + 50  # a paragraph settling and the next begun, not the answer

    done = (question, Turn("assistant", answer, model="smol"))
    transcript.show_turns(done)
    whole = Transcript()
    qtbot.addWidget(whole)
    whole.show_turns(done)
    assert transcript.toPlainText() == whole.toPlainText()
    assert transcript.toPlainText().count("Copy code") == 1
    QGuiApplication.clipboard().clear()
    transcript.anchorClicked.emit(QUrl("copy:1:0"))
    assert QGuiApplication.clipboard().text() == "print('the storm')\n\nprint('passed')"


def test_a_streaming_answer_shows_its_settled_paragraphs_as_written_whole(qtbot) -> None:
    from studio.chat_transcript import Transcript

    answer = ("# Plan\n\nFirst:\n\n1. read\n2. write\n\n```\ncode()\n\nmore()\n```\n\n"
              "| a | b |\n|---|---|\n| 1 | 2 |\n\nThe end, **bold**.")
    question = Turn("user", "Plan?")
    streamed, whole = Transcript(), Transcript()
    qtbot.addWidget(streamed)
    qtbot.addWidget(whole)
    for end in range(1, len(answer) + 1):
        turns = (question, Turn("assistant", answer[:end], AnswerState.STREAMING, model="smol"))
        streamed.show_turns(turns)
        whole.show_turns(())
        whole.show_turns(turns)
        assert streamed.toPlainText() == whole.toPlainText(), answer[:end]
    code = streamed.document().find("more()")
    assert monospaced(code.charFormat().font())


def test_a_slow_redraw_spaces_the_next_while_an_answer_streams(qtbot, monkeypatch) -> None:
    """A redraw that took long makes the next wait three times as long (the transcript
    takes at most a quarter of the window's time), then shows the newest state; the end
    of an answer is shown at once."""
    clock = [100.0]
    view = ChatView(clock=lambda: clock[0])
    qtbot.addWidget(view)
    drawn: list[str] = []
    show_turns = view.transcript.show_turns

    def slow_show_turns(turns: tuple[Turn, ...]) -> None:
        show_turns(turns)
        drawn.append(turns[-1].text if turns else "")
        clock[0] += 0.02  # 20 ms a redraw
    monkeypatch.setattr(view.transcript, "show_turns", slow_show_turns)
    question = Turn("user", "Story?")

    def streaming(text: str) -> ChatState:
        return ChatState((question, Turn("assistant", text, AnswerState.STREAMING, model="m")), True)
    view.show_state(streaming("Once"))
    view.show_state(streaming("Once upon"))  # within the 60 ms after a 20 ms redraw
    view.show_state(streaming("Once upon a time"))
    assert drawn == ["Once"] and view.state.turns[-1].text == "Once upon a time"
    clock[0] += 0.06
    qtbot.waitUntil(lambda: drawn == ["Once", "Once upon a time"], timeout=2000)  # the newest
    view.show_state(ChatState((question, Turn("assistant", "Once upon a time.", model="m"))))
    assert drawn[-1] == "Once upon a time."  # the end at once


def test_the_widget_guard_watches_widgets_not_the_application_nor_text_views(qtbot) -> None:
    """The wheel and label rules watch each widget, and text views not at all: a filter
    on the application ran Python (and took the interpreter lock from the port's thread)
    for each of the window's events, a thousand a second while an answer streams."""
    from PySide6.QtWidgets import QLabel, QSpinBox, QTextBrowser, QVBoxLayout, QWidget

    from studio import widgets

    seen: set[str] = set()

    class Counting(widgets._WidgetGuard):
        def eventFilter(self, watched: QObject, event: QEvent) -> bool:
            if event.type() == QEvent.Type.User:
                seen.add(watched.objectName())
            return super().eventFilter(watched, event)

    root = QWidget()
    qtbot.addWidget(root)
    layout = QVBoxLayout(root)
    text, box, label = QTextBrowser(), QSpinBox(), QLabel("<b>model</b>")
    for widget, name in ((root, "root"), (text, "text"), (text.viewport(), "viewport"),
                         (box, "box"), (label, "label")):
        widget.setObjectName(name)
    for widget in (text, box, label):
        layout.addWidget(widget)
    Counting(root).guard(root)
    later = QSpinBox(root)  # a row made later, once shown
    later.setObjectName("later")
    layout.addWidget(later)
    root.show()
    qtbot.waitExposed(root)
    for widget in (root, text, text.viewport(), box, label, later):
        QApplication.sendEvent(widget, QEvent(QEvent.Type.User))
        QApplication.sendEvent(widget, QEvent(QEvent.Type.User))
    assert seen == {"root", "box", "label", "later"}
    assert later.focusPolicy() == box.focusPolicy() == Qt.FocusPolicy.StrongFocus
    assert label.textFormat() == Qt.TextFormat.PlainText
    # The window guards itself, not the application.
    app = QApplication.instance()
    assert app is not None and app.property(widgets._GUARDED) is None


def test_plain_words_added_to_a_long_paragraph_are_added_alone(qtbot) -> None:
    """A long paragraph being written (one without a blank line: no settled paragraphs)
    gets each update's new words added at its end, not written again whole; a mark
    (emphasis here) has the paragraph written again, and the end reads as written whole."""
    from studio.chat_transcript import Transcript

    words = " Once the keeper climbed the stairs and the light turned over the sea" * 40
    answer = words + "and then *the storm* came."
    question = Turn("user", "A story")
    streamed, whole = Transcript(), Transcript()
    qtbot.addWidget(streamed)
    qtbot.addWidget(whole)
    added: list[int] = []
    streamed.document().contentsChange.connect(lambda _at, _removed, n: added.append(n))
    most = 0
    for end in range(40, len(answer) + 1, 7):
        turns = (question, Turn("assistant", answer[:end], AnswerState.STREAMING, model="smol"))
        added.clear()
        streamed.show_turns(turns)
        if 40 < end < len(words):  # after the first, which writes the turn
            most = max(most, sum(added))
        whole.show_turns(())
        whole.show_turns(turns)
        assert streamed.toPlainText() == whole.toPlainText(), answer[:end]
    assert len(words) > 2000 and most <= 7 + 1  # a word or two, not the paragraph


def test_a_long_paragraph_being_written_is_laid_out_by_its_last_piece(qtbot) -> None:
    """A paragraph being written that grows long is cut where a line wraps: each update
    lays out the last piece alone (a 10,000-character paragraph took 10 ms a time), and
    the pieces look as the paragraph would: as tall, the same text; once it ends they
    stay, but from a piece where a mark is read across the cuts."""
    from studio.chat_transcript import PIECE_CHARS, Transcript

    words = ("Once the keeper climbed the stairs, Смотритель поднялся по лестнице, "
             "灯塔守护者爬上楼梯 and the *light* turned over the sea. ") * 60
    answer = words + "Then *the storm came over " + "the wide grey water " * 60 + "at last*."
    question = Turn("user", "A story")
    streamed, whole = Transcript(), Transcript()
    for view in (streamed, whole):
        qtbot.addWidget(view)
        view.resize(600, 400)
        view.show()
    qtbot.waitExposed(streamed)
    streamed.show_turns((question, Turn("assistant", "", AnswerState.WAITING)))
    longest_block = 0
    for end in range(40, len(answer) + 1, 37):
        turns = (question, Turn("assistant", answer[:end], AnswerState.STREAMING, model="smol"))
        streamed.show_turns(turns)
        longest_block = max(longest_block, streamed.document().lastBlock().length())
        if end % 20 == 0:
            whole.show_turns(())
            whole.show_turns((question, Turn("assistant", answer[:end], model="smol")))
            assert streamed.toPlainText() == whole.toPlainText()
            assert streamed.document().size().height() == whole.document().size().height()
    assert len(answer) > 5 * PIECE_CHARS and longest_block < PIECE_CHARS + 200
    assert streamed.document().blockCount() > 6  # in pieces

    done = (question, Turn("assistant", answer, model="smol"))
    streamed.show_turns(done)
    whole.show_turns(())
    whole.show_turns(done)
    assert streamed.toPlainText() == whole.toPlainText()
    assert streamed.document().size().height() == whole.document().size().height()
    # The pieces before the mark read across cuts are kept; from its piece on, written again.
    assert whole.document().blockCount() == 4 < streamed.document().blockCount()
    assert streamed.document().find("wide grey water").charFormat().fontItalic()
    assert "*" not in streamed.toPlainText()


def test_a_paragraph_in_pieces_is_joined_when_the_view_changes_width(qtbot) -> None:
    """The cuts fall where lines wrapped at the old width: at the next update the
    paragraph is written again whole, then cut at the new width's wraps."""
    from studio.chat_transcript import Transcript

    answer = "The keeper climbed the stairs and the light turned over the sea. " * 60
    question = Turn("user", "A story")
    streamed, whole = Transcript(), Transcript()
    for view in (streamed, whole):
        qtbot.addWidget(view)
        view.resize(600, 400)
        view.show()
    qtbot.waitExposed(streamed)
    for end in range(40, len(answer) // 2, 41):
        half = (question, Turn("assistant", answer[:end], AnswerState.STREAMING))
        streamed.show_turns(half)
    whole.show_turns(half)  # as tall: a scroll bar too
    assert streamed.document().blockCount() > 4
    for view in (streamed, whole):
        view.resize(450, 400)
    qtbot.waitUntil(lambda: streamed.viewport().width() == whole.viewport().width() < 450)
    turns = (question, Turn("assistant", answer, AnswerState.STREAMING))
    streamed.show_turns(turns)
    whole.show_turns(turns)
    assert streamed.toPlainText() == whole.toPlainText()
    assert streamed.document().size().height() == whole.document().size().height()


def test_an_answer_begun_by_a_code_block_shows_and_copies_its_first_line_as_code(qtbot) -> None:
    """Markdown written into a block took that block's format: the first line of an answer
    begun by a code block was shown as text, and Copy code left it out."""
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    from studio.chat_transcript import Transcript

    transcript = Transcript()
    qtbot.addWidget(transcript)
    question = Turn("user", "Code?")
    answer = "```python\nfirst = 1\nsecond = 2\n```\n\nThat is all."
    for end in (len(answer) - 5, len(answer)):
        transcript.show_turns((question, Turn("assistant", answer[:end], AnswerState.STREAMING)))
    transcript.show_turns((question, Turn("assistant", answer)))
    assert monospaced(transcript.document().find("first = 1").charFormat().font())
    QGuiApplication.clipboard().clear()
    transcript.anchorClicked.emit(QUrl("copy:1:0"))
    assert QGuiApplication.clipboard().text() == "first = 1\nsecond = 2"


def test_an_answer_that_ends_writes_its_last_paragraph_alone(qtbot) -> None:
    """When a streamed answer ends, its settled paragraphs stay as written: its last
    paragraph and its figures are written, not the whole answer again (35-111 ms of the
    window's thread for 10,000 characters when the cores were busy), and a long last
    paragraph shown in pieces keeps them when they read as it does; it then reads and
    stands as the answer written whole (its paragraphs' margins too), a stopped one too."""
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    from studio.chat_transcript import Transcript

    paragraphs = [f"Paragraph {n}: the keeper climbed the *stairs* again, " + "and the wind " * 8
                  for n in range(12)]
    paragraphs[5] = "```python\nprint('the storm')\n\nprint('passed')\n```"
    paragraphs[-1] = "At last the *light* turned over the sea, " * 40 + "and **dawn** came."
    answer = "\n\n".join(paragraphs)
    question = Turn("user", "A story")
    figures = AnswerFigures(0.5, 20.0, 600, 12, 0)
    for ended in (Turn("assistant", answer, model="smol", figures=figures),
                  Turn("assistant", answer, AnswerState.STOPPED, model="smol", figures=figures)):
        streamed, whole = Transcript(), Transcript()
        for view in (streamed, whole):
            qtbot.addWidget(view)
            view.resize(600, 400)
            view.show()
        qtbot.waitExposed(streamed)
        for end in range(40, len(answer) + 1, 37):
            streamed.show_turns((question, Turn("assistant", answer[:end], AnswerState.STREAMING,
                                                model="smol")))
        last_begins = streamed.document().find("Paragraph 10:").block().next().position()
        changed: list[int] = []
        streamed.document().contentsChange.connect(lambda at, _removed, _added: changed.append(at))
        streamed.show_turns((question, ended))
        whole.show_turns((question, ended))
        # From the break before the last paragraph on: the settled ones untouched.
        assert changed and min(changed) >= last_begins - 1
        assert streamed.toPlainText() == whole.toPlainText()
        assert streamed.document().size().height() == whole.document().size().height()
        settled = streamed.document().find("Paragraph 10:").block()
        assert streamed.document().find("Paragraph 10:", settled.position() + 1).isNull()
        as_whole = whole.document().find("Paragraph 10:").blockFormat()
        assert (settled.blockFormat().topMargin(), settled.blockFormat().bottomMargin()) \
            == (as_whole.topMargin(), as_whole.bottomMargin()) == (6, 6)
        assert streamed.document().find("dawn").charFormat() \
            == whole.document().find("dawn").charFormat()
        note = figures.describe() if ended.state is AnswerState.DONE \
            else f"Stopped · {figures.describe()}"
        assert streamed.toPlainText().splitlines()[-1] == note
        assert streamed.document().blockCount() > whole.document().blockCount()  # in pieces
        assert streamed.document().size().height() == whole.document().size().height()
        assert streamed.document().find("dawn").charFormat().fontWeight() == 700
        QGuiApplication.clipboard().clear()
        streamed.anchorClicked.emit(QUrl("copy:1:0"))
        assert QGuiApplication.clipboard().text() == "print('the storm')\n\nprint('passed')"


def test_a_paragraph_kept_in_pieces_reads_copies_and_rewraps_as_one(qtbot) -> None:
    """A long paragraph that ended in pieces keeps them (cut where lines wrap: it looks
    the same), is not written again, copies without breaks between its pieces, and is
    written whole again when the view's width changes (the cuts no longer fall at wraps)."""
    from PySide6.QtGui import QGuiApplication, QTextCursor

    from studio.chat_transcript import Transcript

    answer = ("Once the keeper climbed the stairs, Смотритель поднялся по лестнице, "
              "灯塔守护者爬上楼梯 and the *light* turned over the sea. ") * 40
    question = Turn("user", "A story")
    streamed, whole = Transcript(), Transcript()
    for view in (streamed, whole):
        qtbot.addWidget(view)
        view.resize(600, 400)
        view.show()
    qtbot.waitExposed(streamed)
    for end in range(40, len(answer) + 1, 37):
        streamed.show_turns((question, Turn("assistant", answer[:end], AnswerState.STREAMING,
                                            model="smol")))
    pieces = streamed.document().blockCount()
    assert pieces > 6
    first_piece = streamed.document().findBlock(streamed.document().find("Once").position())
    changed: list[int] = []
    streamed.document().contentsChange.connect(lambda at, _removed, _added: changed.append(at))
    done = (question, Turn("assistant", answer.strip(), model="smol"))
    streamed.show_turns(done)
    whole.show_turns(done)
    assert min(changed) > first_piece.position() + first_piece.length()  # its pieces kept
    assert streamed.document().blockCount() >= pieces - 1
    assert streamed.toPlainText() == whole.toPlainText()
    assert streamed.document().size().height() == whole.document().size().height()

    cursor = QTextCursor(streamed.document())
    cursor.setPosition(first_piece.position())
    cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
    streamed.setTextCursor(cursor)
    QGuiApplication.clipboard().clear()
    streamed.copy()
    assert QGuiApplication.clipboard().text() == answer.strip().replace("*", "")

    for view in (streamed, whole):
        view.resize(450, 400)
    qtbot.waitUntil(lambda: streamed.document().blockCount() == whole.document().blockCount())
    assert streamed.toPlainText() == whole.toPlainText()
    assert streamed.document().size().height() == whole.document().size().height()
