"""The saver writes the window's files off its caller's thread: per file one write at a
time, a burst's last state winning, pending writes flushed at close, failures reported."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

import pytest

from backend.app.saver import Saver, Write
from backend.models.library import ModelLibrary
from backend.private_files import write_private

WAIT = 10.0


class Disk:
    """Writes JSON states to files, records which states reached which file and on which
    thread, and can hold a write until the test lets it go."""

    def __init__(self) -> None:
        self.written: list[tuple[Path, int]] = []
        self.threads: set[int] = set()
        self.started = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def write(self, path: Path, state: int) -> Write:
        def write() -> None:
            self.threads.add(threading.get_ident())
            self.started.set()
            if not self.gate.wait(WAIT):
                raise TimeoutError("the test never let the write go")
            write_private(path, json.dumps({"state": state}).encode())
            self.written.append((path, state))
        return write

    def hold(self) -> None:
        self.started.clear()
        self.gate.clear()

    async def wait_until_writing(self) -> None:
        assert await asyncio.to_thread(self.started.wait, WAIT)


def state_of(path: Path) -> int:
    return int(json.loads(path.read_text())["state"])


async def test_a_burst_of_saves_writes_the_first_and_then_only_the_last(tmp_path: Path) -> None:
    saver, disk = Saver(), Disk()
    path = tmp_path / "config" / "settings.json"
    disk.hold()
    first = saver.save(path, disk.write(path, 1))
    await disk.wait_until_writing()  # state 1 is on its way to the disk

    later = [saver.save(path, disk.write(path, state)) for state in range(2, 7)]
    disk.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *later), WAIT)

    assert disk.written == [(path, 1), (path, 6)]  # 2 to 5 were superseded, never written
    assert state_of(path) == 6
    assert threading.get_ident() not in disk.threads  # never on the caller's thread


async def test_close_writes_what_is_still_pending(tmp_path: Path) -> None:
    saver, disk = Saver(), Disk()
    settings, library = tmp_path / "settings.json", tmp_path / "library.json"
    for state in (1, 2, 3):
        saver.save(settings, disk.write(settings, state))
    saver.save(library, disk.write(library, 7))

    await asyncio.wait_for(saver.close(), WAIT)

    assert (state_of(settings), state_of(library)) == (3, 7)
    # Asked before any write began: the three states of the settings are one write.
    assert sorted(disk.written) == [(library, 7), (settings, 3)]


async def test_one_file_held_up_does_not_hold_up_another(tmp_path: Path) -> None:
    saver, slow_disk, disk = Saver(), Disk(), Disk()
    slow, quick = tmp_path / "slow.json", tmp_path / "quick.json"
    slow_disk.hold()
    held = saver.save(slow, slow_disk.write(slow, 1))
    await slow_disk.wait_until_writing()

    await asyncio.wait_for(saver.save(quick, disk.write(quick, 2)), WAIT)

    assert state_of(quick) == 2 and not slow.exists() and not held.done()
    slow_disk.gate.set()
    await asyncio.wait_for(saver.close(), WAIT)
    assert state_of(slow) == 1


async def test_a_failed_write_is_reported_not_raised_and_the_next_save_still_writes(
        tmp_path: Path) -> None:
    saver, disk = Saver(), Disk()
    blocker = tmp_path / "config"
    blocker.write_text("a file where the config folder should be")
    path = blocker / "settings.json"
    failures: list[BaseException] = []

    done = saver.save(path, disk.write(path, 1), failures.append)
    await asyncio.wait_for(done, WAIT)  # done, holding no error
    await asyncio.wait_for(saver.flush(), WAIT)

    assert len(failures) == 1 and isinstance(failures[0], OSError)
    assert disk.written == []
    blocker.unlink()
    await asyncio.wait_for(saver.save(path, disk.write(path, 2), failures.append), WAIT)
    assert state_of(path) == 2 and len(failures) == 1


async def test_a_failure_nobody_listens_for_is_logged(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    saver, disk = Saver(), Disk()
    (tmp_path / "config").write_text("not a folder")
    path = tmp_path / "config" / "library.json"

    with caplog.at_level(logging.ERROR, logger="backend.app.saver"):
        saver.save(path, disk.write(path, 1))
        await asyncio.wait_for(saver.close(), WAIT)

    assert "library.json could not be saved" in caplog.text


async def test_a_library_save_writes_the_library_as_it_was_when_saved(tmp_path: Path,
                                                                     loose_umask: None) -> None:
    saver = Saver()
    library = ModelLibrary(tmp_path / "config" / "library.json", locations=[])
    library.add_file(tmp_path / "a.gguf")
    # The state is copied when the save is asked for; what the user does next is the
    # next save's business.
    document = library.document()
    saver.save(library.path, lambda: library.save(document))
    library.add_file(tmp_path / "b.gguf")
    await asyncio.wait_for(saver.close(), WAIT)

    assert ModelLibrary.load(library.path).opened == [str(tmp_path / "a.gguf")]
    assert library.path.stat().st_mode & 0o777 == 0o600  # written as the settings are
