"""Usage per key: requests, tokens, queue waits and refusals, kept across restarts.

Totals per key (`KeyUsage`: what `keys list`, /metrics and the window's table show) and
a time series per key in one-minute buckets over the last 24 hours (`MinuteUsage`: the
window's chart, and the day windows of the rate limiter after a restart:
`day_tokens`).  Memory is bounded by the buckets kept: at most `keep_minutes` (1,440)
per key, each a short list of numbers.

Recording is in memory and costs a dict lookup and a few additions; it happens on the
backend's event loop, so nothing takes a lock.  The file (`usage.json`, next to the
keys, private like them) is written atomically at most every few seconds by `autosave`
(the writing itself in a worker thread, off the event loop), and at close, so a crash
loses at most the last interval.  One process serves the port, so one process writes;
`gguf-studio keys list` only reads.

Keys are named here by their name, never by their secret.  The owner's key is "owner".
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from backend.private_files import make_private, write_private
from backend.settings import APP_NAME

__all__ = ["AUTOSAVE_INTERVAL", "KeyUsage", "MinuteUsage", "UsageLedger", "usage_path"]

log = logging.getLogger("gguf_studio.usage")

FILE_VERSION = 1
#: Seconds between two writes of the file while requests are served.
AUTOSAVE_INTERVAL = 5.0
#: Minutes of series kept per key: a day.
KEEP_MINUTES = 24 * 60

# A minute's bucket: [minute number, requests, prompt tokens, completion tokens,
# seconds waited, waits, refusals].
_MINUTE, _REQUESTS, _PROMPT, _COMPLETION, _WAITED, _WAITS, _REFUSALS = range(7)


@dataclass
class KeyUsage:
    """One key's totals since it was first used."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wait_seconds: float = 0.0
    waits: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    last_used: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def mean_wait(self) -> float | None:
        """Seconds a request of this key waited in line on average (None: none waited)."""
        return self.wait_seconds / self.waits if self.waits else None

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "wait_seconds": round(self.wait_seconds, 6), "waits": self.waits,
                "refusals": dict(self.refusals), "last_used": self.last_used}


@dataclass(frozen=True)
class MinuteUsage:
    """One minute of one key (or of all keys) for the chart."""

    start: float  # seconds since the epoch
    requests: int
    prompt_tokens: int
    completion_tokens: int
    wait_seconds: float
    waits: int
    refusals: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "usage.json"


class UsageLedger:
    """What each key used; see the module's docstring."""

    def __init__(self, path: Path | None = None, *, clock: Callable[[], float] = time.time,
                 keep_minutes: int = KEEP_MINUTES) -> None:
        self.path = path or usage_path()
        self.keep_minutes = keep_minutes
        self._clock = clock
        self._totals: dict[str, KeyUsage] = {}
        self._minutes: dict[str, deque[list[Any]]] = {}
        # The JSON of each key's minutes but the newest, which alone still changes:
        # encoded once, when the minute is over, so that saving a day of minutes of many
        # keys costs a join rather than encoding them all again (50 ms for ten keys).
        self._encoded: dict[str, deque[str]] = {}
        self._changes = 0      # goes up with every record
        self._saved = 0        # the value of _changes the file holds
        # Flushes take turns, so that the newest copy is the one written last.
        self._flushing = asyncio.Lock()
        # The chart's minutes that are over, by (key, span, this minute): `chart_series`.
        self._chart: tuple[tuple[str | None, int, float], list[MinuteUsage]] | None = None

    @classmethod
    def load(cls, path: Path | None = None, *, clock: Callable[[], float] = time.time,
             keep_minutes: int = KEEP_MINUTES, writer: bool = True) -> "UsageLedger":
        """The ledger saved at `path` (empty if there is none).  A file that cannot be
        read is set aside as usage.json.bad by the `writer` (the serving process), with
        a warning, rather than written over: usage is worth keeping but never worth
        refusing to serve for.  A reader (`keys list`) only warns."""
        ledger = cls(path, clock=clock, keep_minutes=keep_minutes)
        if writer:
            make_private(ledger.path)
        try:
            text = ledger.path.read_text(encoding="utf-8")
            ledger._read(json.loads(text))
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError,
                AttributeError) as exc:
            ledger._totals.clear()
            ledger._minutes.clear()
            ledger._encoded.clear()
            reason = getattr(exc, "strerror", None) or f"not a usage file: {exc}"
            if writer:
                ledger._set_aside(reason)
            else:
                log.warning("The usage file %s could not be read (%s).", ledger.path.name,
                            reason)
        return ledger

    # --- recording (the hot path) --------------------------------------------------------

    def record_request(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request of `key` finished, having used these tokens (the engine's `usage`)."""
        now = self._clock()
        totals = self._total(key)
        totals.requests += 1
        totals.prompt_tokens += prompt_tokens
        totals.completion_tokens += completion_tokens
        totals.last_used = now
        bucket = self._bucket(key, now)
        bucket[_REQUESTS] += 1
        bucket[_PROMPT] += prompt_tokens
        bucket[_COMPLETION] += completion_tokens
        self._changes += 1

    def record_wait(self, key: str, seconds: float) -> None:
        """A request of `key` waited `seconds` in line before it was admitted."""
        totals = self._total(key)
        totals.wait_seconds += seconds
        totals.waits += 1
        bucket = self._bucket(key, self._clock())
        bucket[_WAITED] += seconds
        bucket[_WAITS] += 1
        self._changes += 1

    def record_refusal(self, key: str, reason: str) -> None:
        """A request of `key` was refused; `reason` is the refusal's code or limit
        ("tokens_per_minute", "tokens_per_day", "server_is_overloaded", ...)."""
        totals = self._total(key)
        totals.refusals[reason] = totals.refusals.get(reason, 0) + 1
        self._bucket(key, self._clock())[_REFUSALS] += 1
        self._changes += 1

    # --- reading ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, KeyUsage]:
        """Every key's totals, as copies the caller may keep (metrics, the window)."""
        return copy.deepcopy(self._totals)

    def usage(self, key: str) -> KeyUsage:
        """One key's totals (zeros for a key never used), a copy."""
        return copy.deepcopy(self._totals.get(key, KeyUsage()))

    def series(self, key: str | None = None, since: float | None = None,
               until: float | None = None) -> list[MinuteUsage]:
        """The minutes of the last day in which `key` (every key: None) did anything,
        oldest first; with `since` and `until`, only those that start in [since, until):
        a look at the last minutes costs those minutes, not the day."""
        first = self._minute(self._clock()) - self.keep_minutes + 1
        if since is not None:
            first = max(first, math.ceil(since / 60))
        end = math.inf if until is None else math.ceil(until / 60)
        sums: dict[int, list[Any]] = {}
        for name, buckets in self._minutes.items():
            if key is not None and name != key:
                continue
            for bucket in reversed(buckets):  # newest first: the rest are older still
                if bucket[_MINUTE] < first:
                    break
                if bucket[_MINUTE] >= end:
                    continue
                into = sums.setdefault(bucket[_MINUTE], [bucket[_MINUTE], 0, 0, 0, 0.0, 0, 0])
                for i in range(_REQUESTS, _REFUSALS + 1):
                    into[i] += bucket[i]
        return [MinuteUsage(start=m * 60.0, requests=b[_REQUESTS], prompt_tokens=b[_PROMPT],
                            completion_tokens=b[_COMPLETION], wait_seconds=b[_WAITED],
                            waits=b[_WAITS], refusals=b[_REFUSALS])
                for m, b in sorted(sums.items())]

    def chart_series(self, key: str | None, span: int, this_minute: float) -> list[MinuteUsage]:
        """`key`'s minutes over a chart's `span` minutes up to `this_minute`.  The minutes
        that are over are summed once a minute (a day of fifty keys takes 0.2 s, too long
        for the port's loop every second); this minute's, which still change, every time."""
        wanted = (key, span, this_minute)
        if self._chart is None or self._chart[0] != wanted:
            over = self.series(key, since=this_minute - (span - 1) * 60, until=this_minute)
            self._chart = (wanted, over)
        return self._chart[1] + self.series(key, since=this_minute)

    def day_tokens(self, key: str) -> list[tuple[float, int]]:
        """(start of minute, tokens) of the last day, for RateLimiter.preload."""
        return [(m.start, m.total_tokens) for m in self.series(key) if m.total_tokens]

    # --- saving -----------------------------------------------------------------------------

    @property
    def unsaved(self) -> bool:
        return self._changes != self._saved

    def save(self) -> None:
        """Write the file now if anything changed since it was last written."""
        if not self.unsaved:
            return
        changes, data = self._changes, self._dump()
        write_private(self.path, data)
        self._saved = changes

    async def flush(self) -> None:
        """`save`, with the writing in a worker thread (the copy is taken here, on the
        event loop, where the recording happens).  Flushes at once take turns."""
        async with self._flushing:
            if not self.unsaved:
                return
            changes, data = self._changes, self._dump()
            await asyncio.to_thread(write_private, self.path, data)
            self._saved = changes

    async def autosave(self, interval: float = AUTOSAVE_INTERVAL) -> None:
        """Write the file every `interval` seconds while something changed, until
        cancelled; then once more, so that closing keeps everything."""
        writing: asyncio.Future[None] | None = None
        try:
            while True:
                await asyncio.sleep(interval)
                writing = asyncio.ensure_future(self.flush())
                try:
                    # Shielded: a thread cannot be stopped, so a cancel waits for it below.
                    await asyncio.shield(writing)
                except OSError as exc:
                    log.warning("Usage could not be saved (%s); trying again later.",
                                exc.strerror or exc)
        finally:
            if writing is not None and not writing.done():
                with contextlib.suppress(OSError):
                    await writing
            try:
                self.save()
            except OSError as exc:
                log.warning("Usage could not be saved (%s).", exc.strerror or exc)

    # --- helpers ----------------------------------------------------------------------------

    def _total(self, key: str) -> KeyUsage:
        totals = self._totals.get(key)
        if totals is None:
            totals = self._totals[key] = KeyUsage()
        return totals

    def _bucket(self, key: str, now: float) -> list[Any]:
        minute = self._minute(now)
        buckets = self._minutes.get(key)
        if buckets is None:
            buckets = self._minutes[key] = deque()
            self._encoded[key] = deque()
        if buckets and buckets[-1][_MINUTE] >= minute:
            return buckets[-1]  # this minute (or the newest, the clock having gone back)
        encoded = self._encoded[key]
        if buckets:
            encoded.append(_encode(buckets[-1]))
        buckets.append([minute, 0, 0, 0, 0.0, 0, 0])
        while buckets[0][_MINUTE] <= minute - self.keep_minutes:
            buckets.popleft()
            encoded.popleft()
        return buckets[-1]

    @staticmethod
    def _minute(now: float) -> int:
        return math.floor(now / 60)

    def _dump(self) -> bytes:
        first = self._minute(self._clock()) - self.keep_minutes + 1
        keys = []
        for name, usage in self._totals.items():
            buckets = self._minutes.get(name, deque())
            stale = 0  # minutes gone out of the day since the key's last record
            while stale < len(buckets) and buckets[stale][_MINUTE] < first:
                stale += 1
            minutes = list(itertools.islice(self._encoded.get(name, ()), stale, None))
            if buckets and buckets[-1][_MINUTE] >= first:
                minutes.append(_encode(buckets[-1]))
            entry = json.dumps(usage.to_json(), separators=(",", ":"))
            keys.append(f'{json.dumps(name)}:{entry[:-1]},"minutes":[{",".join(minutes)}]}}')
        return f'{{"version":{FILE_VERSION},"keys":{{{",".join(keys)}}}}}'.encode()

    def _read(self, saved: Any) -> None:
        if saved.get("version") != FILE_VERSION:
            raise ValueError(f"format {saved.get('version')!r}")
        for name, entry in saved["keys"].items():
            refusals = {str(k): int(v) for k, v in entry.get("refusals", {}).items()}
            last_used = entry.get("last_used")
            self._totals[str(name)] = KeyUsage(
                requests=int(entry["requests"]), prompt_tokens=int(entry["prompt_tokens"]),
                completion_tokens=int(entry["completion_tokens"]),
                wait_seconds=float(entry["wait_seconds"]), waits=int(entry["waits"]),
                refusals=refusals, last_used=None if last_used is None else float(last_used))
            buckets: deque[list[Any]] = deque()
            for bucket in entry.get("minutes", []):
                if len(bucket) != 7:
                    raise ValueError("a minute of usage has the wrong length")
                row = [int(bucket[0]), int(bucket[1]), int(bucket[2]), int(bucket[3]),
                       float(bucket[4]), int(bucket[5]), int(bucket[6])]
                if buckets and row[_MINUTE] <= buckets[-1][_MINUTE]:
                    raise ValueError("minutes out of order")
                buckets.append(row)
            self._minutes[str(name)] = buckets
            self._encoded[str(name)] = deque(_encode(b) for b in list(buckets)[:-1])

    def _set_aside(self, reason: str) -> None:
        aside = self.path.with_name(self.path.name + ".bad")
        log.warning("The usage file %s could not be read (%s); it is kept as %s and usage "
                    "counts start again.", self.path.name, reason, aside.name)
        with contextlib.suppress(OSError):
            os.replace(self.path, aside)


def _encode(bucket: list[Any]) -> str:
    return json.dumps(bucket, separators=(",", ":"))
