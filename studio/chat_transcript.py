"""The Chat tab's conversation as a document: who speaks, what they said as Markdown (code
blocks in a fixed font on a tinted ground, each with a Copy code link), and each answer's
figures."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QUrl
from PySide6.QtGui import (QColor, QFont, QGuiApplication, QPalette, QTextBlock, QTextBlockFormat,
                           QTextCharFormat, QTextCursor, QTextDocument, QTextFormat)
from PySide6.QtWidgets import QTextBrowser

from backend.app.chat_session import AnswerState, Turn
from studio.widgets import monospace_font

__all__ = ["MARKDOWN", "Transcript"]

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
        cursor.insertMarkdown(text, MARKDOWN)
        self._add_copy_links(start, cursor.position(), number)
        note = _note(turn)
        if note:
            quiet = QTextCharFormat()
            quiet.setForeground(self.palette().color(QPalette.ColorRole.PlaceholderText))
            quiet.setFontItalic(True)
            cursor.insertBlock(QTextBlockFormat(), quiet)
            cursor.insertText(note, quiet)

    def _add_copy_links(self, start: int, end: int, number: int) -> None:
        """A "Copy code" link under each code block of the text from `start` to `end`
        (turn `number`'s), which copies the block's code."""
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
            self.codes[(number, index)] = "\n".join(lines)
            link = QTextCharFormat()
            link.setAnchor(True)
            link.setAnchorHref(f"copy:{number}:{index}")
            link.setForeground(self.palette().color(QPalette.ColorRole.Link))
            link.setFontPointSize(max(7.0, self.font().pointSizeF() * 0.85))
            cursor = QTextCursor(last)
            cursor.movePosition(QTextCursor.MoveOperation.EndOfBlock)
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
            cursor.insertText("⧉ Copy code", link)

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
