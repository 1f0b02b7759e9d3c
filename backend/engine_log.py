"""llama-server's output: read line by line without a length limit, cut for display.

llama-server writes whatever it likes on one line (with `-v` a whole converted request,
100 KB and more).  asyncio's `readline` gives up on lines over 64 KiB, and a reader that
stops lets the pipe fill, after which every engine thread that logs blocks, and so does
every request.  `read_lines` reads fixed-size chunks and never stops on a long line:
it keeps the first `FILE_LINE_BYTES` of a line (the log file holds that much) and counts
the rest; `for_display` cuts a line to what the window's log view and the tail show.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

__all__ = ["DISPLAY_LINE_CHARS", "FILE_LINE_BYTES", "for_display", "read_lines"]

# The log file keeps lines up to this long; longer ones are cut with a note of how much.
FILE_LINE_BYTES = 1 << 20
# The tail and the window show this much of a line.
DISPLAY_LINE_CHARS = 2000

_CHUNK = 1 << 16


async def read_lines(stream: asyncio.StreamReader, limit: int = FILE_LINE_BYTES
                     ) -> AsyncIterator[str]:
    """Each line of `stream` (without its newline), decoded; a line longer than `limit`
    bytes keeps its first `limit` bytes and ends with a note of how many were cut.
    Memory stays bounded by `limit` whatever the line length."""
    pending = bytearray()
    dropped = 0
    while chunk := await stream.read(_CHUNK):
        start = 0
        while start <= len(chunk):
            newline = chunk.find(b"\n", start)
            end = newline if newline >= 0 else len(chunk)
            room = max(0, limit - len(pending))
            pending += chunk[start:min(end, start + room)]
            dropped += max(0, end - start - room)
            if newline < 0:
                break
            yield _finish(pending, dropped)
            pending.clear()
            dropped = 0
            start = newline + 1
    if pending or dropped:
        yield _finish(pending, dropped)


def for_display(line: str, limit: int = DISPLAY_LINE_CHARS) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… [{len(line) - limit} more characters]"


def _finish(raw: bytearray, dropped: int) -> str:
    line = raw.decode("utf-8", errors="replace").rstrip("\r")
    return f"{line}… [{dropped} more bytes cut]" if dropped else line
