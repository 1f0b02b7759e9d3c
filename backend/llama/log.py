"""llama-server's output: read line by line without a length limit, cut for display.

llama-server writes whatever it likes on one line (with `-v` a whole converted request,
100 KB and more).  asyncio's `readline` gives up on lines over 64 KiB, and a reader that
stops lets the pipe fill, after which every engine thread that logs blocks, and so does
every request.  `read_lines` reads fixed-size chunks and never stops on a long line:
it keeps the first `FILE_LINE_BYTES` of a line (the log file holds that much) and counts
the rest; `for_display` cuts a line to what the window's log view and the tail show.

`EngineLogFile` writes one engine start's log from a thread of its own (the event loop
only queues lines) and keeps it bounded: a file that reaches `max_bytes` is moved to
`<name>.1` (replacing the previous one) and started afresh, and when a model starts
again only its `keep_starts` newest logs are kept.  So one model's logs take at most
`keep_starts x 2 x max_bytes` (5 x 2 x 8 MiB by default).

`is_routine` tells the lines an idle engine writes over and over (the port's health and
slot polls, "all slots are idle") from those worth reading: the window's log view hides
them unless asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import AsyncIterator

__all__ = ["DISPLAY_LINE_CHARS", "FILE_LINE_BYTES", "EngineLogFile", "for_display",
           "is_routine", "read_lines"]

# The log file keeps lines up to this long; longer ones are cut with a note of how much.
FILE_LINE_BYTES = 1 << 20
# The tail and the window show this much of a line.
DISPLAY_LINE_CHARS = 2000

_CHUNK = 1 << 16


class EngineLogFile:
    """The log of one engine start, written off the event loop and bounded in size."""

    def __init__(self, path: Path, *, max_bytes: int = 8 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._closed = False
        self._file = path.open("a", encoding="utf-8", errors="replace")
        self._size = self._file.tell()
        self._thread = threading.Thread(target=self._write_all, name=f"log {path.name}", daemon=True)
        self._thread.start()

    @classmethod
    def for_start(cls, log_dir: Path, model: str, port: int, *, max_bytes: int = 8 << 20,
                  keep_starts: int = 5) -> "EngineLogFile":
        """A new log for `model` in `log_dir`, after removing all but its `keep_starts - 1`
        newest earlier logs."""
        log_dir.mkdir(parents=True, exist_ok=True)
        prefix = f"llama-server-{_safe_name(model)}-"
        newest: dict[str, int] = {}  # each earlier start's log name -> its last write
        for path in log_dir.glob(prefix + "*.log*"):
            if _is_log_of(path.name, prefix):
                name = path.name.removesuffix(".1")
                with contextlib.suppress(OSError):
                    newest[name] = max(newest.get(name, 0), path.stat().st_mtime_ns)
        by_age = sorted(newest, key=lambda name: (newest[name], name), reverse=True)
        for name in by_age[max(0, keep_starts - 1):]:
            for stale in (log_dir / name, log_dir / (name + ".1")):
                stale.unlink(missing_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return cls(log_dir / f"{prefix}{stamp}-{port}.log", max_bytes=max_bytes)

    def write(self, line: str) -> None:
        """Queue one line (without its newline); never blocks the caller."""
        if not self._closed:
            self._lines.put(line)

    def close(self) -> None:
        """Write what is queued, then close the file.  Blocks: call it off the loop."""
        if not self._closed:
            self._closed = True
            self._lines.put(None)
        self._thread.join()

    def _write_all(self) -> None:
        try:
            while (line := self._lines.get()) is not None:
                self._write(line + "\n")
                if self._lines.empty():
                    self._file.flush()
        finally:
            self._file.close()

    def _write(self, text: str) -> None:
        size = len(text.encode("utf-8", errors="replace"))
        if self._size and self._size + size > self.max_bytes:
            self._file.close()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self._file = self.path.open("w", encoding="utf-8", errors="replace")
            self._size = 0
        self._file.write(text)
        self._size += size


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


def is_routine(line: str) -> bool:
    """Whether `line` is one an engine writes over and over while nothing happens: its
    answers to the port's polls of /health, /slots and /props, and its idle loop."""
    return _ROUTINE.search(line) is not None


#: llama-server's lines for the port's polls and its idle loop (pinned llama.cpp).
_ROUTINE = re.compile(r"all slots are idle|GET /(?:health|slots|props)\b"
                      r"|start_loop: (?:processing new tasks|update slots|waiting for new tasks)")


def for_display(line: str, limit: int = DISPLAY_LINE_CHARS) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… [{len(line) - limit} more characters]"


def _finish(raw: bytearray, dropped: int) -> str:
    line = raw.decode("utf-8", errors="replace").rstrip("\r")
    return f"{line}… [{dropped} more bytes cut]" if dropped else line


def _safe_name(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model)[:80] or "model"


def _is_log_of(name: str, prefix: str) -> bool:
    """True for `<prefix><stamp>-<n>-<port>.log[.1]`, not another model whose name merely
    starts like this one's."""
    return re.fullmatch(re.escape(prefix) + r"\d{8}-\d{6}-\d+\.log(\.1)?", name) is not None
