"""The Chat tab's conversation as a document: who speaks, what they said as Markdown (code
blocks in a fixed font on a tinted ground, each with a Copy code link), and each answer's
figures.

An answer that streams is redone by its last paragraph only: the paragraphs before the
last blank line outside a code fence (`settled_length`) are written once, as they settle,
so a long answer costs each update the paragraph being written, not the whole answer
again (the window's loop stayed busy re-reading ten thousand characters of Markdown twenty
times a second).  Once the answer ends it is written whole, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QUrl
from PySide6.QtGui import (QColor, QFont, QGuiApplication, QPalette, QTextBlock, QTextBlockFormat,
                           QTextCharFormat, QTextCursor, QTextDocument, QTextFormat)
from PySide6.QtWidgets import QTextBrowser

from backend.app.chat_session import AnswerState, Turn
from studio.widgets import monospace_font

__all__ = ["MARKDOWN", "Transcript", "settled_length"]

#: Markdown as GitHub writes it, without raw HTML: a model's text is never markup for Qt.
MARKDOWN = QTextDocument.MarkdownFeature(
    QTextDocument.MarkdownFeature.MarkdownDialectGitHub.value
    | QTextDocument.MarkdownFeature.MarkdownNoHTML.value)


class Transcript(QTextBrowser):
    """The conversation as a document: who speaks, what they said as Markdown (code blocks
    in a fixed font on a tinted ground), and each answer's figures."""

    def __init__(self) -> None:
        super().__init__()
        self.setOpenLinks(False)  # a model's links are text to read, not places to go
        self.setUndoRedoEnabled(False)
        self._shown: tuple[Turn, ...] = ()
        self._starts: list[int] = []  # where each shown turn begins in the document
        #: The code of each code block shown, by (turn, block): what its Copy link copies.
        self.codes: dict[tuple[int, int], str] = {}
        #: The answer streaming now, as far as it is shown (None: none streams).
        self._stream: _Stream | None = None
        self.anchorClicked.connect(self._on_link)

    def show_turns(self, turns: tuple[Turn, ...]) -> None:
        """Show `turns`, redoing only those from the first that changed: while an answer
        streams, that is the answer alone, however long the conversation before it."""
        same = 0
        while same < min(len(turns), len(self._shown)) and turns[same] is self._shown[same]:
            same += 1
        if same == len(turns) == len(self._shown):
            return
        bar = self.verticalScrollBar()
        following = bar.value() >= bar.maximum() - 4
        position = bar.value()
        document = self.document()
        cursor = QTextCursor(document)
        stream = self._stream
        if stream is not None and stream.number == same == len(turns) - 1 == len(self._shown) - 1 \
                and turns[same].state is AnswerState.STREAMING \
                and turns[same].text.startswith(self._shown[same].text):
            # The streaming answer grew: its paragraph being written, and any it settled
            # (plain words added to plain words: only those).
            if not self._append_words(stream, turns[same].text):
                cursor.setPosition(stream.tail)
                cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
                cursor.removeSelectedText()
                self._write_stream(cursor, stream, turns[same].text)
                self._tint_code(document, document.findBlock(stream.tail_before_tint))
            self._shown = turns
            bar.setValue(bar.maximum() if following else position)
            return
        self._stream = None
        if same == 0:
            document.clear()
        elif same < len(self._starts):
            cursor.setPosition(self._starts[same])
            cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()
        else:  # turns added after those shown
            cursor.movePosition(QTextCursor.MoveOperation.End)
        del self._starts[same:]
        for number in range(same, len(turns)):
            self._starts.append(cursor.position())
            self._add_turn(cursor, turns[number], number)
        self._shown = turns
        if same < len(turns):
            self._tint_code(document, document.findBlock(self._starts[same]))
        bar.setValue(bar.maximum() if following else position)

    def only_grows(self, turns: tuple[Turn, ...]) -> bool:
        """Whether `turns` are those shown but for the streaming answer, which is longer
        and still streams (showing them may wait a moment)."""
        shown = self._shown
        return (self._stream is not None and len(turns) == len(shown) > 0
                and turns[-1].state is AnswerState.STREAMING
                and all(a is b for a, b in zip(turns[:-1], shown[:-1]))
                and turns[-1].text.startswith(shown[-1].text))

    def loadResource(self, kind: int, name: QUrl | str) -> Any:
        return None  # nothing a model wrote is fetched, not even a local file

    def _add_turn(self, cursor: QTextCursor, turn: Turn, number: int) -> None:
        first = number == 0
        heading = QTextCharFormat()
        heading.setFontWeight(QFont.Weight.Bold)
        spaced = QTextBlockFormat()
        spaced.setTopMargin(0 if first else 14)
        if not first:
            cursor.insertBlock(spaced, heading)
        else:
            cursor.setBlockFormat(spaced)
            cursor.setCharFormat(heading)
        who = "You" if turn.role == "user" else turn.model or "Model"
        cursor.insertText(who, heading)
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        text = turn.text
        if turn.role == "assistant" and turn.state is AnswerState.WAITING:
            text = "…"
        # Each turn is read on its own: a code fence a stopped answer left open ends with it.
        start = cursor.position()
        if turn.role == "assistant" and turn.state is AnswerState.STREAMING:
            self._stream = _Stream(number, tail=start)
            self._write_stream(cursor, self._stream, text)
        else:
            cursor.insertMarkdown(text, MARKDOWN)
            self._add_copy_links(start, cursor.position(), number)
        note = _note(turn)
        if note:
            quiet = QTextCharFormat()
            quiet.setForeground(self.palette().color(QPalette.ColorRole.PlaceholderText))
            quiet.setFontItalic(True)
            cursor.insertBlock(QTextBlockFormat(), quiet)
            cursor.insertText(note, quiet)

    def _write_stream(self, cursor: QTextCursor, stream: _Stream, text: str) -> None:
        """The streaming answer's `text` from the end of its settled paragraphs (where
        `cursor` is, the rest removed): the paragraphs that settled since, once, then the
        one being written."""
        stream.tail_before_tint = stream.tail
        settled = settled_length(text)
        if settled > stream.chars:
            begin = _insert_blocks(cursor, text[stream.chars:settled], after=stream.chars > 0)
            stream.codes += self._add_copy_links(begin, cursor.position(), stream.number,
                                                 stream.codes)
            stream.chars, stream.tail = settled, cursor.position()
        rest = text[stream.chars:]
        stream.words = None
        if rest:
            begin = _insert_blocks(cursor, rest, after=stream.chars > 0)
            self._add_copy_links(begin, cursor.position(), stream.number, stream.codes)
            shown = QTextCursor(self.document())
            shown.setPosition(begin)
            shown.setPosition(cursor.position(), QTextCursor.MoveMode.KeepAnchor)
            if shown.selectedText() == rest.strip(" "):  # a paragraph shown as written
                stream.words = rest.rstrip(" ")  # the spaces at its end come with a word

    def _append_words(self, stream: _Stream, text: str) -> bool:
        """Whether the streaming answer's `text` only adds plain words to a paragraph of
        plain words, now added at its end: laying out the paragraph again is what a long
        one costs, not writing it (a tenth of it)."""
        words = stream.words
        rest = text[stream.chars:]
        # Begun by a letter, the paragraph can become no list, heading, quote or code.
        if words is None or not words.lstrip(" ")[:1].isalpha() or not rest.startswith(words) \
                or settled_length(text) != stream.chars:
            return False
        # Spaces at the end are shown with the next word (Markdown drops them at the end).
        added = rest[len(words):].rstrip(" ")
        if added and not _plain_words(words[-12:], added):
            return False
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(added, QTextCharFormat())
        stream.words = words + added
        return True

    def _add_copy_links(self, start: int, end: int, number: int, first: int = 0) -> int:
        """A "Copy code" link under each code block of the text from `start` to `end`
        (turn `number`'s, whose code blocks before `start` are `first`), which copies the
        block's code; how many code blocks there were."""
        document = self.document()
        groups: list[tuple[QTextBlock, list[str]]] = []
        block = document.findBlock(start)
        previous_code = False
        while block.isValid() and block.position() <= end:
            code = block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)
            if code and previous_code:
                groups[-1] = (block, [*groups[-1][1], block.text()])
            elif code:
                groups.append((block, [block.text()]))
            previous_code = code
            block = block.next()
        for index in range(len(groups) - 1, -1, -1):  # from the end: positions stay valid
            last, lines = groups[index]
            self.codes[(number, first + index)] = "\n".join(lines)
            link = QTextCharFormat()
            link.setAnchor(True)
            link.setAnchorHref(f"copy:{number}:{first + index}")
            link.setForeground(self.palette().color(QPalette.ColorRole.Link))
            link.setFontPointSize(max(7.0, self.font().pointSizeF() * 0.85))
            cursor = QTextCursor(last)
            cursor.movePosition(QTextCursor.MoveOperation.EndOfBlock)
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
            cursor.insertText("⧉ Copy code", link)
        return len(groups)

    def _on_link(self, url: QUrl) -> None:
        text = url.toString()
        if text.startswith("copy:"):
            turn, _, index = text.removeprefix("copy:").partition(":")
            code = self.codes.get((int(turn), int(index)))
            if code is not None:
                QGuiApplication.clipboard().setText(code)

    def _tint_code(self, document: QTextDocument, block: QTextBlock) -> None:
        """Code blocks from `block` on: a tinted ground and a fixed font."""
        ground = self.palette().color(QPalette.ColorRole.AlternateBase)
        if ground == self.palette().color(QPalette.ColorRole.Base):
            ground = QColor(127, 127, 127, 40)
        cursor = QTextCursor(document)
        while block.isValid():
            if block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
                cursor.setPosition(block.position())
                tinted = block.blockFormat()
                tinted.setBackground(ground)
                cursor.setBlockFormat(tinted)
                cursor.select(QTextCursor.SelectionType.BlockUnderCursor)
                mono = QTextCharFormat()
                mono.setFont(monospace_font())
                cursor.mergeCharFormat(mono)
            block = block.next()


def _note(turn: Turn) -> str:
    if turn.role != "assistant":
        return ""
    figures = turn.figures.describe() if turn.figures is not None else ""
    if turn.state is AnswerState.STOPPED:
        return "Stopped" + (f" · {figures}" if figures else "")
    if turn.state is AnswerState.FAILED:
        return turn.error
    return figures if turn.state is AnswerState.DONE else ""


def _insert_blocks(cursor: QTextCursor, markdown: str, *, after: bool) -> int:
    """`markdown` at `cursor`, in blocks of its own when `after` blocks before it (as
    written whole: a list or a table that begins it leaves no empty paragraph before it);
    where its first block begins."""
    if after:
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
    begin = cursor.position()
    cursor.insertMarkdown(markdown, MARKDOWN)
    block = cursor.document().findBlock(begin)
    following = block.next()
    if after and block.length() == 1 and following.isValid() \
            and following.position() <= cursor.position() \
            and QTextCursor(following).currentTable() is None:  # a table keeps one before it
        QTextCursor(block).deletePreviousChar()  # the empty one joins the block before
    return begin


def _plain_words(before: str, added: str) -> bool:
    """Whether `added`, after text ending in `before`, reads as written in Markdown: no
    mark (emphasis, code, links, escapes, entities, a new line) and no autolink begun."""
    joined = before + added
    return not _MARKS.intersection(added) and "www." not in joined and "://" not in joined \
        and "@" not in added


_MARKS = frozenset("\\`*_[]<>!~|&#\n\r\t")


def settled_length(text: str) -> int:
    """How much of a streaming answer's `text` is whole paragraphs that read the same
    whatever comes next: up to its last blank line outside a code fence."""
    settled = position = 0
    fence = ""
    while (end := text.find("\n", position)) >= 0:
        line = text[position:end]
        stripped = line.strip()
        indented = len(line) - len(line.lstrip(" "))
        if not fence and indented <= 3 and stripped[:3] in ("```", "~~~"):
            fence = stripped[:3]
        elif fence and stripped.startswith(fence) and not stripped.strip(fence[0]):
            fence = ""
        elif not fence and not stripped:
            settled = end + 1
        position = end + 1
    return settled


@dataclass
class _Stream:
    """The streaming answer as shown: turn `number`, whose first `chars` characters
    (`codes` code blocks among them) are settled paragraphs, written up to document
    position `tail`."""

    number: int
    tail: int
    chars: int = 0
    codes: int = 0
    #: Where this update's writing began (its code blocks are tinted from there).
    tail_before_tint: int = 0
    #: The paragraph being written, when it is plain words shown as written (new words
    #: are added at its end); else None.
    words: str | None = None
