"""The Chat tab's conversation as a document: who speaks, what they said as Markdown (code
blocks in a fixed font on a tinted ground, each with a Copy code link), and each answer's
figures.

An answer that streams is redone by its last paragraph only: the paragraphs before the
last blank line outside a code fence (`settled_length`) are written once, as they settle,
so a long answer costs each update the paragraph being written, not the whole answer
again (the window's loop stayed busy re-reading ten thousand characters of Markdown twenty
times a second).  Once the answer ends, its last paragraph is written whole, once: the
settled ones stay as written (writing the whole answer again took 35-111 ms of the window's
thread for 10,000 characters in many scripts when the cores were busy).

A long paragraph being written is shown in pieces, one block each, cut where a line wraps
(`PIECE_CHARS`): each update lays out its last piece alone.  Qt lays a block out whole at
each change, and a paragraph of ten thousand characters in many scripts took 10 ms a time
(stretched to 30-100 ms when the engine and the port's clients had the cores).  Cut at a
wrap, the pieces look as the paragraph would; they are joined again when the paragraph
settles or the view's width changes.  When the answer ends, those that read as the
paragraph written whole stay (compared in a scratch document, not laid out); they read and
copy as one paragraph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QMimeData, QUrl
from PySide6.QtGui import (QColor, QFont, QGuiApplication, QPalette, QTextBlock, QTextBlockFormat,
                           QTextCharFormat, QTextCursor, QTextDocument, QTextFormat)
from PySide6.QtWidgets import QTextBrowser

from backend.app.chat_session import AnswerState, Turn
from studio.markdown_blocks import (CONTINUES, MARKDOWN, clip, format_runs, insert_blocks,
                                    insert_markdown, joined, plain_paragraph, plain_words,
                                    settled_length)
from studio.widgets import monospace_font

__all__ = ["PIECE_CHARS", "Transcript"]

#: A paragraph being written longer than this is cut at its last line's wrap: each update
#: then lays out at most about this much text (about 1 ms in many scripts).
PIECE_CHARS = 800

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
        self._scratch = QTextDocument()  # Markdown read aside, to find where to cut
        #: A paragraph of an answer that ended is still shown in pieces.
        self._pieces = False
        self.anchorClicked.connect(self._on_link)

    def toPlainText(self) -> str:
        """The conversation's text; a paragraph shown in pieces reads as one."""
        return joined(super().toPlainText(), self.document(), 0)

    def createMimeDataFromSelection(self) -> QMimeData:
        """The selection to copy or drag: a paragraph shown in pieces copies as one."""
        data = super().createMimeDataFromSelection()
        if not self._pieces:
            return data
        cursor = self.textCursor()
        text = data.text()
        as_one = joined(text, self.document(), cursor.selectionStart(), cursor.selectionEnd())
        if as_one == text:
            return data
        plain = QMimeData()  # as text alone: its rich forms have the pieces as paragraphs
        plain.setText(as_one)
        return plain

    def resizeEvent(self, event: Any) -> None:
        super().resizeEvent(event)
        if event.size().width() == event.oldSize().width():
            return
        if self._pieces:  # cut where lines wrapped at the old width: written again whole
            turns, self._shown, self._stream, self._pieces = self._shown, (), None, False
            self.show_turns(turns)
        elif self._stream is not None:
            self._stream.rejoin = True  # the pieces' cuts no longer fall where lines wrap

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
            # (plain words added to plain words: only those; else its last piece alone).
            # One edit: the view lays it out once (removed then written again, a long
            # paragraph took the scroll bar away and back, and the whole conversation was
            # laid out again at each width).
            text = turns[same].text
            cursor.beginEditBlock()
            if stream.rejoin or settled_length(text) != stream.chars:
                self._rewrite_from(cursor, stream, stream.tail, text)
            elif not self._append_words(stream, text):
                cut = stream.piece_chars > stream.chars
                self._rewrite_from(cursor, stream, stream.piece_begin if cut else stream.tail, text)
            cursor.endEditBlock()
            self._cut_at_wrap(stream, text)
            self._shown = turns
            bar.setValue(bar.maximum() if following else position)
            return
        if stream is not None and stream.number == same == len(turns) - 1 == len(self._shown) - 1 \
                and turns[same].state not in (AnswerState.STREAMING, AnswerState.WAITING) \
                and turns[same].text.startswith(self._shown[same].text) \
                and turns[same].model == self._shown[same].model \
                and "|" not in turns[same].text[stream.chars:] \
                and not self._has_table(self._starts[same]):
            # The streaming answer ended: its last paragraph written whole, then its note.
            # (An answer with a table is written whole: written after a paragraph, a table
            # keeps an empty block before it that the answer written whole has not.)
            cursor.beginEditBlock()
            if not self._keep_pieces(cursor, stream, turns[same].text):
                self._rewrite_from(cursor, stream, stream.tail, turns[same].text, ended=True)
            cursor.movePosition(QTextCursor.MoveOperation.End)
            self._add_note(cursor, turns[same])
            cursor.endEditBlock()
            self._stream = None
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
            self._stream = _Stream(number, tail=start, piece_begin=start)
            self._write_stream(cursor, self._stream, text)
            self._cut_at_wrap(self._stream, text)
        else:
            insert_markdown(cursor, text)
            self._add_copy_links(start, cursor.position(), number)
        self._add_note(cursor, turn)

    def _add_note(self, cursor: QTextCursor, turn: Turn) -> None:
        """Under an answer, at `cursor`: its figures, or why it stopped."""
        note = _note(turn)
        if note:
            quiet = QTextCharFormat()
            quiet.setForeground(self.palette().color(QPalette.ColorRole.PlaceholderText))
            quiet.setFontItalic(True)
            cursor.insertBlock(QTextBlockFormat(), quiet)
            cursor.insertText(note, quiet)

    def _has_table(self, begin: int) -> bool:
        """Whether the document shows a table from position `begin` on."""
        return any(frame.firstPosition() >= begin
                   for frame in self.document().rootFrame().childFrames())

    def _keep_pieces(self, cursor: QTextCursor, stream: _Stream, text: str) -> bool:
        """Whether the streaming answer, ended as `text`, ends with its paragraph being
        written in pieces that read as the paragraph written whole, but maybe from one
        on (a mark opened in one piece and closed in another), now written from there:
        the pieces before it are kept (laying the whole paragraph out again took 35-111 ms
        at 10,000 characters in many scripts when the cores were busy)."""
        rest = text[stream.chars:]
        if stream.rejoin or stream.piece_chars <= stream.chars or not rest.strip():
            return False
        scratch = self._scratch
        scratch.setMarkdown(rest, MARKDOWN)
        whole = scratch.firstBlock()
        if scratch.blockCount() != 1 or not plain_paragraph(whole):
            return False
        document = self.document()
        block = document.findBlock(stream.tail)
        if block.position() != stream.tail:
            block = block.next()
        runs, written = format_runs(whole), whole.text()
        offset = 0
        kept = 0  # characters of the paragraph in pieces kept as they are
        while block.isValid() and block.position() < stream.piece_begin:
            end = offset + block.length() - 1
            if block.text() != written[offset:end] or format_runs(block) != clip(runs, offset, end):
                break
            offset = kept = end
            block = block.next()
        if kept == 0 or not block.isValid():
            return False
        cursor.setPosition(block.position())
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()  # the last piece's block format is left: the paragraph's end
        rest_of_it = QTextCursor(scratch)
        rest_of_it.setPosition(kept)
        rest_of_it.movePosition(QTextCursor.MoveOperation.EndOfBlock,
                                QTextCursor.MoveMode.KeepAnchor)
        cursor.insertFragment(rest_of_it.selection())
        self._pieces = True
        return True

    def _rewrite_from(self, cursor: QTextCursor, stream: _Stream, position: int,
                      text: str, *, ended: bool = False) -> None:
        """The streaming answer written again from document `position`: the end of its
        settled paragraphs (`stream.tail`), or the last piece of the one being written;
        all of `text` as settled once it has `ended`."""
        document = self.document()
        top_margin = document.findBlock(position).blockFormat().topMargin()
        cursor.setPosition(position)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        if position == stream.tail:
            stream.rejoin = False
            self._write_stream(cursor, stream, text, ended=ended)
            # Removed from a block's start, the last block's format is left there: a last
            # piece's, which the paragraph's first block is not.
            first = QTextCursor(document.findBlock(position))
            block_format = first.blockFormat()
            if block_format.boolProperty(CONTINUES):
                block_format.clearProperty(CONTINUES)
                block_format.setTopMargin(top_margin)
                first.setBlockFormat(block_format)
        else:
            self._write_piece(cursor, stream, text)
        self._tint_code(document, document.findBlock(stream.tail_before_tint))

    def _write_stream(self, cursor: QTextCursor, stream: _Stream, text: str, *,
                      ended: bool = False) -> None:
        """The streaming answer's `text` from the end of its settled paragraphs (where
        `cursor` is, the rest removed): the paragraphs that settled since, once, then the
        one being written (none once the answer has `ended`)."""
        stream.tail_before_tint = stream.tail
        settled = len(text) if ended else settled_length(text)
        if settled > stream.chars:
            begin = insert_blocks(cursor, text[stream.chars:settled], after=stream.chars > 0)
            stream.codes += self._add_copy_links(begin, cursor.position(), stream.number,
                                                 stream.codes)
            stream.chars, stream.tail = settled, cursor.position()
        stream.piece_chars, stream.piece_begin = stream.chars, stream.tail
        rest = text[stream.chars:]
        stream.words = None
        if rest:
            begin = insert_blocks(cursor, rest, after=stream.chars > 0)
            stream.piece_begin = begin
            self._add_copy_links(begin, cursor.position(), stream.number, stream.codes)
            self._note_words(stream, begin, cursor.position(), rest)

    def _write_piece(self, cursor: QTextCursor, stream: _Stream, text: str) -> None:
        """The last piece of the paragraph being written, from where `cursor` is (at the
        start of its block, the rest removed), in the block format it had."""
        stream.tail_before_tint = stream.piece_begin
        block_format = cursor.blockFormat()
        block_format.setTopMargin(0)
        block_format.setProperty(CONTINUES, True)
        rest = text[stream.piece_chars:]
        stream.words = None
        if rest:
            insert_markdown(cursor, rest)
            QTextCursor(self.document().findBlock(stream.piece_begin)).setBlockFormat(block_format)
            self._note_words(stream, stream.piece_begin, cursor.position(), rest)

    def _note_words(self, stream: _Stream, begin: int, end: int, rest: str) -> None:
        """Whether the paragraph shown from `begin` to `end` is `rest` as written (new
        words can then be added at its end)."""
        shown = QTextCursor(self.document())
        shown.setPosition(begin)
        shown.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
        if shown.selectedText() == rest.strip(" "):  # a paragraph shown as written
            stream.words = rest.rstrip(" ")  # the spaces at its end come with a word

    def _cut_at_wrap(self, stream: _Stream, text: str) -> None:
        """A long last piece of a plain paragraph being written cut where its last line
        begins, when its Markdown cut there reads the same in two (a mark opened before the
        cut and closed after it does not)."""
        rest = text[stream.piece_chars:]
        if len(rest) < PIECE_CHARS or len(text) < stream.next_cut_at:
            return
        stream.next_cut_at = len(text) + PIECE_CHARS // 4  # a failed try waits for more
        block = self.document().lastBlock()
        layout = block.layout()
        if block.position() != stream.piece_begin or not plain_paragraph(block) \
                or layout is None or layout.lineCount() < 2:
            return
        shown = block.text()
        wrap = layout.lineAt(layout.lineCount() - 1).textStart()
        cut = self._source_cut(rest, shown[:wrap].rstrip(" "), shown[wrap:])
        if cut is None:
            return
        # The margin below the paragraph goes to its last piece, none between them.
        first, last = block.blockFormat(), block.blockFormat()
        first.setBottomMargin(0)
        last.setTopMargin(0)
        last.setProperty(CONTINUES, True)
        ends = QTextCursor(block)
        ends.beginEditBlock()
        ends.setPosition(block.position() + wrap)
        ends.insertBlock()
        ends.setBlockFormat(last)
        QTextCursor(block).setBlockFormat(first)
        ends.endEditBlock()
        stream.piece_chars += cut
        stream.piece_begin = ends.position()
        stream.next_cut_at = 0
        stream.words = None
        ends.movePosition(QTextCursor.MoveOperation.End)
        self._note_words(stream, stream.piece_begin, ends.position(), text[stream.piece_chars:])

    def _source_cut(self, markdown: str, head: str, tail: str) -> int | None:
        """Where to cut `markdown` (one paragraph) so that its two parts read `head` and
        `tail` on their own; None if nowhere."""
        low, high = 0, len(markdown)
        while low < high:  # the shortest beginning that reads as long as `head`
            middle = (low + high) // 2
            shown = self._read(markdown[:middle])
            if shown is None:
                return None
            if len(shown.rstrip(" ")) < len(head):
                low = middle + 1
            else:
                high = middle
        for cut in range(low, min(low + 4, len(markdown))):
            while cut < len(markdown) and markdown[cut] == " ":
                cut += 1
            before = self._read(markdown[:cut])
            if before is not None and before.rstrip(" ") == head \
                    and self._read(markdown[cut:]) == tail:
                return cut
        return None

    def _read(self, markdown: str) -> str | None:
        """`markdown`'s text as one block reads it; None if it reads as more."""
        self._scratch.setMarkdown(markdown, MARKDOWN)
        return self._scratch.firstBlock().text() if self._scratch.blockCount() == 1 else None

    def _append_words(self, stream: _Stream, text: str) -> bool:
        """Whether the streaming answer's `text` only adds plain words to a paragraph of
        plain words, now added at its end: laying out the paragraph again is what a long
        one costs, not writing it (a tenth of it)."""
        words = stream.words
        rest = text[stream.piece_chars:]
        # Begun by a letter, the paragraph can become no list, heading, quote or code.
        if words is None or not words.lstrip(" ")[:1].isalpha() or not rest.startswith(words) \
                or settled_length(text) != stream.chars:
            return False
        # Spaces at the end are shown with the next word (Markdown drops them at the end).
        added = rest[len(words):].rstrip(" ")
        if added and not plain_words(words[-12:], added):
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
    #: Where the last piece of the paragraph being written begins: in the answer's text
    #: and in the document (`chars` and `tail` while it is in one piece).
    piece_chars: int = 0
    piece_begin: int = 0
    #: The last piece, when it is plain words shown as written (new words are added at
    #: its end); else None.
    words: str | None = None
    #: The answer's length from which the last piece may be cut (a cut that failed waits).
    next_cut_at: int = 0
    #: The view's width changed: the pieces are joined at the next update.
    rejoin: bool = False
