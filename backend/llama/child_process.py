"""Starting and ending the engine's child processes (builds, llama-server, RPC workers)
so that a cancelled caller never leaves one running.

`asyncio.create_subprocess_exec` starts the child and then awaits its pipes' connection:
a task cancelled in between (the owner pressing Unload during a load, a build stopped
at its first compile line) gets CancelledError while the child runs on, owned by nobody,
its transport reported unclosed when the loop ends.  `spawn` finishes starting it out of
the cancellation's reach, then ends and reaps it.  Every child here gets its own session
(its own process group), so ending it ends what it started too: ninja's compilers, which
would otherwise run on holding the pipe open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

__all__ = ["end_process_group", "spawn"]


async def spawn(*args: str, **kwargs: Any) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_exec(*args, start_new_session=True, **kwargs)`, safe to
    cancel: a child started as its caller was cancelled is ended and reaped."""
    starting = asyncio.ensure_future(
        asyncio.create_subprocess_exec(*args, start_new_session=True, **kwargs))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await end_process_group(await starting)
        raise


async def end_process_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL to the child's process group (it leads its own session), then reap it and
    read its pipes to their end."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.communicate()
