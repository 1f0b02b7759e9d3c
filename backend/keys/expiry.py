"""A key's expiry as people type it, and moments as people read them.

`keys add|edit --expires` and the window's key dialog take a date (the key works through
that day), a moment, a span from now or "never" (`parse_expiry`); an expiry must lie
ahead when it is set (`check_future`); every moment a key shows (its expiry, when it was
revoked or last used, when a teammate asked) reads as local time to the minute
(`describe_time`); in a narrow table, a moment of today as its time alone and an older one
as its day (`describe_recent`).
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta

from backend.errors import KeyStoreError

__all__ = ["check_future", "describe_recent", "describe_time", "parse_expiry"]


def parse_expiry(text: str, now: float | None = None) -> float | None:
    """An expiry as people type it, as seconds since the epoch; None for "never".

    "2026-03-31" (the key works through that day, local time), "2026-03-31T18:00" (local
    time unless an offset or Z is given), or a span from now: "30d", "12h", "2w"."""
    text = text.strip()
    now = time.time() if now is None else now
    if text.lower() in {"never", "none"}:
        return None
    span = re.fullmatch(r"(\d+)\s*([hdw])", text.lower())
    if span:
        hours = {"h": 1, "d": 24, "w": 24 * 7}[span[2]] * int(span[1])
        if hours == 0:
            raise KeyStoreError(f"The expiry {text!r} is now; give a span of at least 1h.")
        return now + hours * 3600
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            day = datetime.strptime(text, "%Y-%m-%d")
            moment = (day + timedelta(days=1)).astimezone()  # the end of that day, local
        else:
            moment = datetime.fromisoformat(text.replace(" ", "T", 1))
            if moment.tzinfo is None:
                moment = moment.astimezone()
    except (ValueError, OverflowError):
        raise KeyStoreError(f"The expiry {text!r} is not a date: give 2026-03-31, "
                            "2026-03-31T18:00, a span such as 30d, 12h or 2w, or never.") from None
    expires = moment.timestamp()
    check_future(expires, now)
    return expires


def describe_time(when: float) -> str:
    """A moment as people read it: local time, to the minute."""
    return datetime.fromtimestamp(when).astimezone().strftime("%Y-%m-%d %H:%M")


def describe_recent(when: float, now: float) -> str:
    """A moment as a narrow column shows it: "14:05" today, "2026-03-31" before (local
    time; `describe_time` has both)."""
    moment = datetime.fromtimestamp(when).astimezone()
    if moment.date() == datetime.fromtimestamp(now).astimezone().date():
        return moment.strftime("%H:%M")
    return moment.strftime("%Y-%m-%d")


def check_future(expires_at: float | None, now: float) -> None:
    """Refuse an expiry that is not ahead of `now`."""
    if expires_at is not None and expires_at <= now:
        raise KeyStoreError(f"The expiry {describe_time(expires_at)} is in the past.")
