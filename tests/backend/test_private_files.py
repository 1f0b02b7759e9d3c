"""Private files: written whole, 0600 in a 0700 directory, whoever else writes at once."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from backend.private_files import write_private


def test_a_written_file_is_private_and_whole(tmp_path: Path, loose_umask: None):
    path = tmp_path / "gguf-studio" / "keys.json"
    write_private(path, b"first")
    write_private(path, b"second")

    assert path.read_bytes() == b"second"
    assert os.listdir(path.parent) == ["keys.json"]
    if os.name != "nt":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_writers_at_once_each_replace_the_file_whole(tmp_path: Path):
    # The app's autosave and `gguf-studio keys` can write one file at the same moment.
    path = tmp_path / "usage.json"
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def write(n: int) -> None:
        start.wait()
        try:
            for _ in range(50):
                write_private(path, str(n).encode() * 1000)
        except BaseException as exc:  # reported below, not lost in the thread
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert failures == []
    data = path.read_bytes()
    assert len(set(data)) == 1 and len(data) == 1000
    assert os.listdir(tmp_path) == ["usage.json"]


def test_a_failed_write_leaves_the_old_file_and_no_litter(tmp_path: Path, monkeypatch):
    path = tmp_path / "settings.json"
    write_private(path, b"old")

    def refuse(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        write_private(path, b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["settings.json"]
