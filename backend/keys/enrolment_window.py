"""When the port takes enrolment requests: one rule, read by the enrolment endpoint,
`/health`, the Sharing tab and `serve`.

Enrolment (a teammate asking for a key, `gguf-studio connect`) is open only while the
owner accepts requests:

* the port requires keys (a port without one needs no enrolment), and
* the owner did not turn enrolment off (`serve --no-enrolment`: `allow_enrolment`), and
* either the port is announced on the network (`serve --advertise`, the Sharing tab's
  *Announce*, while it listens beyond loopback: the owner invites teammates to find it),
  or an accept window is open: `serve --accept-enrolments MINUTES`, the Sharing tab's
  *Accept requests* switch (`Settings.accept_enrolments_until`, a wall-clock time).

Anyone on the network can ask while it is open; closed, the door is not there (404
`enrolment_closed`, with `closed_message`).  Requests made while it was open are still
answered once an accept window ends (`answers_polls`: the owner may approve them later,
and their requester collects the key), not once keys or enrolment are turned off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from backend.addresses import is_loopback
from backend.errors import SettingsError
from backend.settings import Settings

__all__ = ["ACCEPTING", "ANNOUNCED", "DEFAULT_ACCEPT_MINUTES", "MAX_ACCEPT_MINUTES", "NO_KEY",
           "NOT_ACCEPTING", "TURNED_OFF", "EnrolmentWindow", "accepting_until",
           "enrolment_window"]

#: The accept window the Sharing tab's switch opens unless told otherwise: as long as an
#: unanswered request waits (`Settings.enrolment_ttl`'s default).
DEFAULT_ACCEPT_MINUTES = 10
#: The longest accept window: a day.  Longer is leaving the door open, which announcing
#: the port says more plainly.
MAX_ACCEPT_MINUTES = 24 * 60

#: Why it is open or closed (`EnrolmentWindow.reason`).
NO_KEY, TURNED_OFF, ANNOUNCED, ACCEPTING, NOT_ACCEPTING = (
    "no_key", "turned_off", "announced", "accepting", "not_accepting")


@dataclass(frozen=True)
class EnrolmentWindow:
    """Whether the port takes enrolment requests now, why, and until when the owner's
    accept window runs (wall clock; None: none does), which opens it only when the port
    requires keys and enrolment is on."""

    open: bool
    reason: str
    until: float | None = None

    @property
    def answers_polls(self) -> bool:
        """Whether requests already made are answered (their polls, their key)."""
        return self.open or self.reason == NOT_ACCEPTING

    def closed_message(self) -> str:
        """What a teammate knocking at a closed door reads."""
        if self.reason == NO_KEY:
            return "This server requires no key, so it takes no enrolment requests."
        if self.reason == TURNED_OFF:
            return "This server takes no enrolment requests; ask its owner for a key."
        return ("This server is not accepting enrolment requests now. Ask its owner to accept "
                "requests (the Sharing tab, or gguf-studio serve --accept-enrolments MINUTES), "
                "then run gguf-studio connect again.")

    def describe(self) -> str:
        """What the owner reads (the Sharing tab, `serve`)."""
        until = "" if self.until is None else f" until {_clock(self.until)}"
        if self.reason == NO_KEY:
            return "Teammates cannot ask for a key: the port requires none."
        if self.reason == TURNED_OFF:
            return "Teammates cannot ask for a key: enrolment is turned off."
        if self.reason == ANNOUNCED:
            return ("Teammates may ask for a key while the port is announced on the network"
                    + (f", and{until}." if until else "."))
        if self.reason == ACCEPTING:
            return f"Teammates may ask for a key{until} (gguf-studio connect)."
        return ("Teammates cannot ask for a key now: announce the port on the network, or "
                "accept requests for a while.")

    def to_dict(self) -> dict[str, Any]:
        """For /health: open, why, and the accept window's end (ISO 8601, UTC) if any."""
        until = (None if self.until is None else
                 datetime.fromtimestamp(self.until, timezone.utc).isoformat(timespec="seconds"))
        return {"open": self.open, "reason": self.reason, "accepting_until": until}


def enrolment_window(settings: Settings, *, keys_required: bool,
                     now: float | None = None) -> EnrolmentWindow:
    """The rule of the module's docstring, for `settings` at wall-clock `now`."""
    now = time.time() if now is None else now
    until = settings.accept_enrolments_until if settings.accept_enrolments_until > now else None
    if not keys_required:
        return EnrolmentWindow(False, NO_KEY, until)
    if not settings.allow_enrolment:
        return EnrolmentWindow(False, TURNED_OFF, until)
    if settings.advertise and not is_loopback(settings.host):
        return EnrolmentWindow(True, ANNOUNCED, until)
    if until is not None:
        return EnrolmentWindow(True, ACCEPTING, until)
    return EnrolmentWindow(False, NOT_ACCEPTING)


def accepting_until(minutes: float, now: float | None = None) -> float:
    """`Settings.accept_enrolments_until` for an accept window of `minutes` from `now`
    (0: closed); SettingsError beyond `MAX_ACCEPT_MINUTES`."""
    if not 0 <= minutes <= MAX_ACCEPT_MINUTES:
        raise SettingsError(f"Accept enrolment requests for 0 to {MAX_ACCEPT_MINUTES} minutes "
                            f"(a day), not {minutes:g}; announce the port to keep it open.")
    if minutes == 0:
        return 0.0
    return (time.time() if now is None else now) + minutes * 60


def _clock(when: float) -> str:
    """A wall-clock time as the owner reads it: 14:32 today, else with the date."""
    moment = datetime.fromtimestamp(when)
    if moment.date() == datetime.now().date():
        return moment.strftime("%H:%M")
    return moment.strftime("%Y-%m-%d %H:%M")
