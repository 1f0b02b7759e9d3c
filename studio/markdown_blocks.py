"""Markdown in a Qt text document, block by block: what the Chat tab's transcript
(`studio.chat_transcript`) writes an answer with.

`insert_markdown` and `insert_blocks` write Markdown at a cursor as Qt writes it whole
(a first block's format and margins kept); `settled_length` says how much of a streaming
answer is whole paragraphs; `plain_words` whether added text reads as written; a
paragraph shown in pieces (blocks marked `CONTINUES`) reads and copies as one (`joined`);
`format_runs` and `clip` compare a block's character formats with Markdown read aside.
"""

from __future__ import annotations

from PySide6.QtGui import (QTextBlock, QTextBlockFormat, QTextCharFormat, QTextCursor,
                           QTextDocument, QTextFormat)

__all__ = ["CONTINUES", "FRAME_BEGINS", "MARKDOWN", "clip", "insert_blocks", "insert_markdown",
           "format_runs", "joined", "plain_paragraph", "plain_words", "settled_length"]

#: Markdown as GitHub writes it, without raw HTML: a model's text is never markup for Qt.
MARKDOWN = QTextDocument.MarkdownFeature(
    QTextDocument.MarkdownFeature.MarkdownDialectGitHub.value
    | QTextDocument.MarkdownFeature.MarkdownNoHTML.value)

#: The character where a frame (a table) begins in a document's text.
FRAME_BEGINS = "\ufdd0"

#: A block that goes on with the paragraph of the block before it (cut at a wrap).
CONTINUES = QTextFormat.Property.UserProperty + 1


def plain_paragraph(block: QTextBlock) -> bool:
    """Whether `block` is a paragraph of text: no heading, list, quote, table or code."""
    block_format = block.blockFormat()
    return block.textList() is None and block_format.headingLevel() == 0 \
        and not block_format.hasProperty(QTextFormat.Property.BlockCodeFence) \
        and not block_format.hasProperty(QTextFormat.Property.BlockQuoteLevel) \
        and QTextCursor(block).currentTable() is None


def joined(text: str, document: QTextDocument, start: int, end: int | None = None) -> str:
    """`text`, `document`'s plain text from position `start` (to `end`), without the
    breaks between the pieces of a paragraph (plain text and positions match one for one)."""
    cuts = []
    block = document.findBlock(start).next()
    while block.isValid() and (end is None or block.position() <= end):
        if block.blockFormat().boolProperty(CONTINUES):
            cuts.append(block.position() - 1 - start)
        block = block.next()
    for cut in reversed(cuts):
        text = text[:cut] + text[cut + 1:]
    return text


def format_runs(block: QTextBlock) -> list[tuple[int, int, QTextCharFormat]]:
    """`block`'s text as runs of one character format: (begin, end, format)."""
    runs: list[tuple[int, int, QTextCharFormat]] = []
    fragments = block.begin()
    while not fragments.atEnd():
        fragment = fragments.fragment()
        begin = fragment.position() - block.position()
        end = begin + fragment.length()
        if runs and runs[-1][1] == begin and runs[-1][2] == fragment.charFormat():
            runs[-1] = (runs[-1][0], end, runs[-1][2])
        else:
            runs.append((begin, end, fragment.charFormat()))
        fragments += 1
    return runs


def clip(runs: list[tuple[int, int, QTextCharFormat]], begin: int,
          end: int) -> list[tuple[int, int, QTextCharFormat]]:
    """The `runs` from `begin` to `end`, counted from `begin`."""
    return [(max(a, begin) - begin, min(b, end) - begin, char_format)
            for a, b, char_format in runs if a < end and b > begin]


def insert_blocks(cursor: QTextCursor, markdown: str, *, after: bool) -> int:
    """`markdown` at `cursor`, in blocks of its own when `after` blocks before it (as
    written whole: a list or a table that begins it leaves no empty paragraph before it);
    where its first block begins."""
    if after:
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
    begin = cursor.position()
    insert_markdown(cursor, markdown, apart=after)
    block = cursor.document().findBlock(begin)
    following = block.next()
    # A table keeps the one before it (seen by its frame's mark: within an edit the
    # table is not known yet).
    if after and block.length() == 1 and following.isValid() \
            and following.position() <= cursor.position() \
            and cursor.document().characterAt(following.position() - 1) != FRAME_BEGINS:
        QTextCursor(block).deletePreviousChar()  # the empty one joins the block before
    return begin


def insert_markdown(cursor: QTextCursor, markdown: str, *, apart: bool = False) -> None:
    """`markdown` at `cursor`, its first block as Markdown makes it: inserted into a
    block, Qt keeps that block's format (an answer begun by a code block showed its first
    line as text, and Copy code left it out; a paragraph written `apart` from those before
    it, as a streaming answer's are, lacked the margins it has in the answer written whole)."""
    begin = cursor.position()
    cursor.insertMarkdown(markdown, MARKDOWN)
    if not _SCRATCH:
        _SCRATCH.append(QTextDocument())
    _SCRATCH[0].setMarkdown(markdown, MARKDOWN)
    made = _SCRATCH[0].firstBlock().blockFormat()
    first = cursor.document().findBlock(begin)
    if made.hasProperty(QTextFormat.Property.BlockCodeFence) or made.headingLevel() \
            or made.hasProperty(QTextFormat.Property.BlockQuoteLevel):
        if first.blockFormat() != made:
            QTextCursor(first).setBlockFormat(made)
    elif apart and QTextCursor(_SCRATCH[0].firstBlock()).currentTable() is None:
        spaced = first.blockFormat()  # a list's item stays in its list: the margins alone
        if (spaced.topMargin(), spaced.bottomMargin()) != (made.topMargin(), made.bottomMargin()):
            spaced.setTopMargin(made.topMargin())
            spaced.setBottomMargin(made.bottomMargin())
            QTextCursor(first).setBlockFormat(spaced)


#: A document to read Markdown aside in (made once the application is).
_SCRATCH: list[QTextDocument] = []


def plain_words(before: str, added: str) -> bool:
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
