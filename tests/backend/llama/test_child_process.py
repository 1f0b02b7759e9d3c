"""A child started as its caller is cancelled is ended with what it started, not left
running: the real processes, a shell that starts a grandchild and says both pids."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from backend.llama.child_process import end_process_group, spawn


def alive(pid: int) -> bool:
    """Running: a zombie is not (only its parent's wait would remove it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def running_with(token: str) -> list[int]:
    """The running processes (not zombies) whose arguments hold `token`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if token.encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            pass  # it ended meanwhile
    return found


async def still_running(running: Callable[[], list[int]]) -> list[int]:
    """What `running` still finds once a killed process had time to die (SIGKILL is
    delivered when the process next runs: a grandchild nobody waits for may take a moment)."""
    deadline = time.monotonic() + 10
    while (found := running()) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return found


def script(pids: Path) -> list[str]:
    return ["/bin/sh", "-c", f"sleep 600 & echo $$ $! > {pids}.tmp; mv {pids}.tmp {pids}; wait"]


async def started(pids: Path) -> list[int]:
    for _ in range(2000):
        if pids.exists():
            return [int(pid) for pid in pids.read_text().split()]
        await asyncio.sleep(0.005)
    raise AssertionError("the shell never said its pids")


async def test_a_child_started_as_its_caller_is_cancelled_is_ended_with_its_own_children(tmp_path):
    # Cancelled at each point of starting the child, from its first step on, ten times
    # each: whatever ran of it (the shell, its sleeper) is ended.  Without spawn's care,
    # asyncio's and uvloop's own starts left the shell or its sleeper running at 1 to 4
    # steps, not at every try.
    left: list[list[int]] = []
    for steps in [step for step in range(1, 12) for _ in range(10)]:
        # A sleep of its own, found by its arguments (fixed width: none holds another).
        token = f"600.{os.getpid():07d}{len(left):03d}"
        task = asyncio.create_task(spawn("/bin/sh", "-c", f"sleep {token} & wait",
                                         stdout=asyncio.subprocess.PIPE))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await end_process_group(await task)  # started before the cancel reached it
        except asyncio.CancelledError:
            pass
        left.append(await still_running(lambda: running_with(token)))
    assert [pids for pids in left if pids] == []


async def test_ending_a_child_ends_what_it_started_and_reaps_it(tmp_path):
    pids = tmp_path / "pids"
    proc = await spawn(*script(pids), stdout=asyncio.subprocess.PIPE)
    shell, sleeper = await started(pids)
    await end_process_group(proc)
    assert proc.returncode is not None  # reaped
    assert await still_running(lambda: [pid for pid in (shell, sleeper) if alive(pid)]) == []


async def test_a_missing_program_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        await spawn(str(tmp_path / "no-such-program"))
