"""Usage per key: totals, a day of minutes for the chart, kept across restarts."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import pytest

from backend.keys.usage import KeyUsage, UsageLedger
from backend.errors import RateLimitExceeded
from backend.admission.rate_limits import RateLimiter, TokenLimits

T0 = 1_750_000_020.0  # the start of a minute


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "config" / "gguf-studio" / "usage.json"


def _busy_ledger(path: Path, clock: Clock) -> UsageLedger:
    ledger = UsageLedger(path, clock=clock)
    ledger.record_wait("alice", 1.5)
    ledger.record_request("alice", 100, 20)
    clock.now += 30
    ledger.record_wait("alice", 0.5)
    ledger.record_request("alice", 300, 40)
    ledger.record_refusal("alice", "tokens_per_minute")
    clock.now += 60
    ledger.record_request("bob", 10, 5)
    ledger.record_refusal("bob", "tokens_per_day")
    ledger.record_refusal("bob", "tokens_per_day")
    return ledger


def test_each_keys_totals_are_counted(path):
    ledger = _busy_ledger(path, Clock())
    usage = ledger.snapshot()
    assert usage["alice"] == KeyUsage(requests=2, prompt_tokens=400, completion_tokens=60,
                                      wait_seconds=2.0, waits=2,
                                      refusals={"tokens_per_minute": 1}, last_used=T0 + 30)
    assert usage["alice"].mean_wait == 1.0 and usage["alice"].total_tokens == 460
    assert usage["bob"].refusals == {"tokens_per_day": 2}
    assert ledger.usage("nobody") == KeyUsage()


def test_a_snapshot_is_the_callers_to_keep(path):
    ledger = _busy_ledger(path, Clock())
    taken = ledger.snapshot()
    taken["alice"].requests = 999
    taken["alice"].refusals["x"] = 1
    assert ledger.usage("alice").requests == 2
    assert "x" not in ledger.usage("alice").refusals


def test_the_series_has_a_bucket_per_busy_minute_per_key_and_for_all(path):
    ledger = _busy_ledger(path, Clock())
    alice = ledger.series("alice")
    assert [(m.start, m.requests, m.total_tokens, m.wait_seconds, m.waits, m.refusals)
            for m in alice] == [(T0, 2, 460, 2.0, 2, 1)]
    everyone = ledger.series()
    assert [(m.start, m.requests, m.total_tokens, m.refusals) for m in everyone] == [
        (T0, 2, 460, 1), (T0 + 60, 1, 15, 2)]


def test_the_series_between_two_moments_has_only_their_minutes(path):
    clock = Clock()
    ledger = UsageLedger(path, clock=clock)
    for _ in range(10):
        ledger.record_request("alice", 10, 1)
        ledger.record_request("bob", 20, 2)
        clock.now += 60
    starts = [m.start for m in ledger.series(since=T0 + 3 * 60, until=T0 + 5 * 60)]
    assert starts == [T0 + 3 * 60, T0 + 4 * 60]
    assert [m.total_tokens for m in ledger.series(since=T0 + 3 * 60, until=T0 + 5 * 60)] == [33, 33]
    assert [m.start for m in ledger.series("alice", since=T0 + 8 * 60 + 1)] == [T0 + 9 * 60]
    assert ledger.series(until=T0) == [] and len(ledger.series(until=T0 + 1)) == 1


def test_the_series_keeps_one_day_and_no_more(path):
    clock = Clock()
    ledger = UsageLedger(path, clock=clock)
    for _ in range(2 * 24 * 60):  # two days, a request a minute
        ledger.record_request("steady", 1, 1)
        clock.now += 60
    clock.now -= 60
    series = ledger.series("steady")
    assert len(series) == 24 * 60
    assert series[0].start == clock.now - (24 * 60 - 1) * 60
    assert ledger.usage("steady").requests == 2 * 24 * 60  # the totals keep everything
    ledger.save()
    saved = json.loads(path.read_text())
    assert len(saved["keys"]["steady"]["minutes"]) == 24 * 60
    clock.now += 5 * 3600  # quiet for five hours: those minutes leave the day, and the file
    ledger.record_refusal("other", "tokens_per_day")
    ledger.save()
    assert len(UsageLedger.load(path, clock=clock).series("steady")) == 19 * 60
    assert len(json.loads(path.read_text())["keys"]["steady"]["minutes"]) == 19 * 60


def test_usage_survives_a_restart(path):
    clock = Clock()
    before = _busy_ledger(path, clock)
    before.save()
    after = UsageLedger.load(path, clock=clock)
    assert after.snapshot() == before.snapshot()
    assert after.series() == before.series()
    after.record_request("alice", 1, 1)
    assert after.usage("alice").requests == 3


def test_the_file_names_keys_and_is_private(path, loose_umask):
    _busy_ledger(path, Clock()).save()
    assert set(json.loads(path.read_text())["keys"]) == {"alice", "bob"}
    if os.name != "nt":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_nothing_is_written_when_nothing_changed(path):
    ledger = UsageLedger(path)
    ledger.save()
    assert not path.exists()
    ledger.record_request("a", 1, 1)
    ledger.save()
    first = path.stat().st_mtime_ns, path.stat().st_ino
    ledger.save()
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == first
    assert not ledger.unsaved


def test_an_unreadable_file_is_set_aside_not_written_over(path, caplog):
    path.parent.mkdir(parents=True)
    path.write_text('{"version": 1, "keys": {"alice": {"requests": "many"}}}')
    assert UsageLedger.load(path, writer=False).snapshot() == {}  # `keys list` moves nothing
    assert path.exists()
    ledger = UsageLedger.load(path)
    assert ledger.snapshot() == {}
    assert "could not be read" in caplog.text and "usage.json.bad" in caplog.text
    assert (path.parent / "usage.json.bad").read_text().startswith('{"version": 1')
    ledger.record_request("alice", 1, 1)
    ledger.save()
    assert UsageLedger.load(path).usage("alice").requests == 1


def test_after_a_restart_the_ledger_refills_the_day_budgets(path):
    clock = Clock()
    ledger = UsageLedger(path, clock=clock)
    ledger.record_request("frank", 7000, 2000)
    ledger.save()
    clock.now += 3600
    limiter = RateLimiter(clock)
    limiter.preload("frank", UsageLedger.load(path, clock=clock).day_tokens("frank"))
    with pytest.raises(RateLimitExceeded) as refused:
        limiter.reserve("frank", TokenLimits(per_day=10_000), 2000)
    assert refused.value.reason == "tokens_per_day"
    assert refused.value.retry_after == pytest.approx(T0 + 60 + 86_400 - clock.now)


# --- saving while serving --------------------------------------------------------------


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _saved_requests(path: Path, key: str) -> int:
    try:
        return json.loads(path.read_text())["keys"][key]["requests"]
    except (OSError, KeyError, ValueError):
        return 0


async def test_autosave_writes_while_serving_and_once_more_at_close(path):
    ledger = UsageLedger(path)
    saving = asyncio.create_task(ledger.autosave(interval=0.02))
    ledger.record_request("alice", 1, 1)
    await _until(lambda: _saved_requests(path, "alice") == 1)
    ledger.record_request("alice", 1, 1)
    await _until(lambda: _saved_requests(path, "alice") == 2)
    saving.cancel()
    await asyncio.gather(saving, return_exceptions=True)

    ledger = UsageLedger(path)
    saving = asyncio.create_task(ledger.autosave(interval=3600))
    ledger.record_request("bob", 1, 1)
    await asyncio.sleep(0)  # the task starts (a task cancelled before it starts runs nothing)
    saving.cancel()
    await asyncio.gather(saving, return_exceptions=True)
    assert _saved_requests(path, "bob") == 1  # written at close, not an hour later


async def test_flushes_at_once_all_succeed_and_the_file_keeps_the_newest_figures(path):
    # A test's flush beside the autosave's made CI fail once: both wrote usage.json.tmp and
    # the second rename found it gone.
    ledger = UsageLedger(path)
    flushes = []
    for n in range(1, 9):
        ledger.record_request("alice", 1, 1)
        flushes.append(asyncio.ensure_future(ledger.flush()))
    await asyncio.gather(*flushes)

    assert _saved_requests(path, "alice") == 8
    assert not ledger.unsaved
    assert sorted(p.name for p in path.parent.iterdir()) == ["usage.json"]
