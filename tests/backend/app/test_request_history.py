"""The request inspector's records across a restart: written private, read back, the
next ids after theirs, and an unreadable file never stops a start."""

from __future__ import annotations

import stat
from pathlib import Path

from backend.app.request_history import load_history, save_history
from backend.port.request_log import RequestLog


def test_the_records_come_back_private_and_the_next_ids_follow(tmp_path: Path) -> None:
    before = RequestLog(3)
    for n in range(5):
        before.add(route="/v1/chat/completions", key="alice", session="codex-7",
                   model="tiny", status=499 if n == 4 else 200, output_tokens=n)
    path = tmp_path / "data" / "request-history.json"
    save_history(path, before)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    after = RequestLog(3)
    assert load_history(path, after) == 3  # bounded as the ring is
    assert after.records() == before.records()
    assert after.since_start == 0  # the Activity tab counts this run's only
    added = after.add(route="/v1/messages", key="bob")
    assert added.id == 6 and after.since_start == 1
    assert [r.id for r in after.records()] == [4, 5, 6]


def test_no_file_or_an_unreadable_one_starts_empty(tmp_path: Path) -> None:
    ring = RequestLog()
    assert load_history(tmp_path / "none.json", ring) == 0
    broken = tmp_path / "broken.json"
    broken.write_text('{"records": [{"id": "x"}')
    assert load_history(broken, ring) == 0 and ring.records() == []
