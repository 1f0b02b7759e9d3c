"""Writes the files the window keeps (the settings, the model library) off its thread.

The window hands over what to save as a value and returns at once; the `Saver` writes it
on an asyncio loop's worker thread (`asyncio.to_thread`), one write at a time per file.
Saves that arrive while a file is being written coalesce: only the last one is written
next, since it holds everything the earlier ones did.  A failed write is reported to the
save's `on_error`, never raised into the caller; `close` writes whatever is still
pending, so quitting loses nothing.

Every method runs on the loop (the backend thread's), like the service's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

__all__ = ["ErrorReport", "Saver", "Write"]

log = logging.getLogger(__name__)

#: Writes one state of one file; blocking, run on a worker thread.
Write = Callable[[], None]
#: Told of a write that failed; runs on the loop.
ErrorReport = Callable[[BaseException], None]


class Saver:
    """Writes files off the caller's thread: per file one write at a time, the last state
    of a burst winning."""

    def __init__(self) -> None:
        self._pending: dict[Path, tuple[Write, ErrorReport | None, asyncio.Future[None]]] = {}
        self._writing: dict[Path, asyncio.Task[None]] = {}

    def save(self, path: Path, write: Write, on_error: ErrorReport | None = None
             ) -> asyncio.Future[None]:
        """Write `path` with `write` soon, replacing any state of it not written yet.  The
        future is done when this state, or a later one, has been written or has failed
        (it never holds an error: failures go to `on_error`, else to the log)."""
        superseded = self._pending.get(path)
        done = superseded[2] if superseded is not None else asyncio.get_running_loop().create_future()
        self._pending[path] = (write, on_error, done)
        if path not in self._writing:
            self._writing[path] = asyncio.create_task(self._write_pending(path))
        return done

    async def flush(self) -> None:
        """Return when every save asked so far has been written (or has failed)."""
        while self._writing:
            await asyncio.gather(*self._writing.values(), return_exceptions=True)

    close = flush  # at exit: nothing asked for may be lost

    async def _write_pending(self, path: Path) -> None:
        try:
            while (job := self._pending.pop(path, None)) is not None:
                write, on_error, done = job
                try:
                    await asyncio.to_thread(write)
                except Exception as exc:
                    _report(path, exc, on_error)
                finally:
                    if not done.done():
                        done.set_result(None)
        finally:
            del self._writing[path]


def _report(path: Path, exc: Exception, on_error: ErrorReport | None) -> None:
    if on_error is None:
        log.error("%s could not be saved: %s", path.name, exc)
        return
    try:
        on_error(exc)
    except Exception:
        log.exception("reporting that %s could not be saved failed", path.name)
