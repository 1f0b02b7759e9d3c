"""Enrolment: a teammate asks the port for a key, the owner approves or refuses.

`gguf-studio connect` on the teammate's machine sends a name (`request`); the port
answers with a short code and a secret id only that requester learns.  The owner sees
the name, the requester's address and the same code in the window or in `gguf-studio
keys requests`, checks the code with the person, and approves **that request** with
limits or refuses it: a decision names the request by its name, code and time asked, so
a request that expired and was replaced by another of the same name (another code) is
never the one approved.  Approving stores the limits; the key is made when the requester
collects it (`wait`/`collect`: its poll), and its secret handed over **once** and never
written to disk here.  An approval not collected before the request expires makes no key.

**Bounded.**  At most `MAX_REQUESTS` requests are kept (pending, or approved and not yet
collected); each expires `ttl` seconds after it was made (600 by default) and is then
forgotten, approved or not.  A refused request gives its place back at once; its
requester still learns the refusal on its next poll (a small bounded memory of refused
ids, `MAX_REFUSED`, which holds no place).  Every request is rate-limited per client
address (`PER_ADDRESS_BURST`, then one per `PER_ADDRESS_EVERY` seconds; at most
`MAX_PER_ADDRESS` waiting at once; `MAX_ADDRESSES` addresses remembered) and for the whole
port (`PORT_BURST`, then one per `PORT_EVERY` seconds): an invalid or taken name costs
its token like an accepted one, so names cannot be tried faster than requests made.  Past
any bound the answer is a 429 with Retry-After.

**Names are not told.**  A name that is a key's, or a waiting request's, gets one answer
(`NAME_TAKEN`, 409), the same for both: a stranger probing names learns only that a name
is in use, at the rate above, never whether it is a key or someone's request.

**Across processes.**  The port mirrors its pending requests (name, address, code,
times; never the id) into `enrolments.json` beside the keys (0600, written under a lock),
where `gguf-studio keys requests|approve|refuse` in another process reads them and
writes its decision (`EnrolmentFile.decide`: the request's name, code and time asked, the
action and the limits); the port takes decisions on its next `sync` (twice a second),
checks each (anything but an explicit "approve" or "refuse" of a request waiting now
fails and approves nothing), and notes the outcome for the command to read.  So a secret
only ever exists in the port's memory and on the wire to its requester.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.keys.enrolment_code import enrolment_code
from backend.errors import (EnrolmentNameTaken, EnrolmentNotFound, EnrolmentNotMade,
                            EnrolmentRefused, EnrolmentsFull, InvalidRequest, KeyStoreError,
                            StudioError, TooManyEnrolments)
from backend.keys.key_store import KeyRecord, KeyStore, check_name, keys_path
from backend.private_files import PRIVATE_FILE_MODE, write_private

__all__ = [
    "APPROVED",
    "DEFAULT_TTL",
    "MAX_REQUESTS",
    "NAME_TAKEN",
    "PENDING",
    "REFUSED",
    "Enrolment",
    "EnrolmentFile",
    "Enrolments",
    "SharedRequest",
    "enrolments_path",
]

#: Requests kept at once, pending or approved and not yet collected.
MAX_REQUESTS = 8
#: Seconds a request waits for the owner (and, approved, for its requester) before it
#: expires and is forgotten.
DEFAULT_TTL = 600.0
#: Requests one address may make at once, then one per PER_ADDRESS_EVERY seconds.
PER_ADDRESS_BURST = 3
PER_ADDRESS_EVERY = 20.0
#: Requests of one address waiting at once.
MAX_PER_ADDRESS = 2
#: Addresses whose rate is remembered; the least recently seen are forgotten first.
MAX_ADDRESSES = 256
#: Requests the port takes at once from everyone, then one per PORT_EVERY seconds.
PORT_BURST = 10
PORT_EVERY = 6.0
#: Refused requests whose requester has not polled yet, remembered (by id only) to tell
#: it "refused"; the oldest are forgotten first (its poll then finds nothing).
MAX_REFUSED = 64
#: Outcomes (approved, collected, refused, failed) kept in the file for `keys` to read.
MAX_OUTCOMES = 16
FILE_VERSION = 1
#: The one answer to a name in use, whether by a key or by a waiting request.
NAME_TAKEN = "That name cannot be given to a new key; choose another name."

PENDING, APPROVED, REFUSED = "pending", "approved", "refused"


@dataclass(frozen=True)
class SharedRequest:
    """A pending request as the owner sees it (the window, `enrolments.json`): no id.
    Its name, code and `requested_at` together name it in a decision."""

    name: str
    address: str
    code: str
    requested_at: float
    expires_at: float


@dataclass
class Enrolment:
    """One request: who asked, from where, the code both screens show; its state."""

    name: str
    address: str
    code: str
    requested_at: float  # wall clock
    expires_at: float  # wall clock
    token: str  # the id only the requester knows (polls carry it)
    state: str = PENDING
    limits: dict[str, Any] = field(default_factory=dict)  # the owner's, once approved
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def expires_in(self, now: float) -> float:
        return max(0.0, self.expires_at - now)

    def shared(self) -> SharedRequest:
        return SharedRequest(self.name, self.address, self.code, self.requested_at,
                             self.expires_at)

    def is_the(self, name: str, code: str, requested_at: float) -> bool:
        """Whether this is the request the owner checked (`name`, `code`, `requested_at`)."""
        return (self.name.casefold() == name.casefold() and self.code == code
                and self.requested_at == requested_at)


class Enrolments:
    """The port's enrolment requests (on the service's loop)."""

    def __init__(self, keys: KeyStore, *, path: Path | None = None,
                 ttl: Callable[[], float] = lambda: DEFAULT_TTL,
                 clock: Callable[[], float] = time.time,
                 on_change: Callable[[], None] | None = None) -> None:
        self.keys = keys
        self.file = EnrolmentFile(path or enrolments_path())
        self._ttl = ttl
        self._clock = clock
        self._on_change = on_change
        self._by_token: dict[str, Enrolment] = {}
        #: Ids of refused requests not yet told, with when each would have expired.
        self._refused: OrderedDict[str, float] = OrderedDict()
        self._addresses: OrderedDict[str, _Bucket] = OrderedDict()
        self._port = _Bucket(PORT_BURST, PORT_EVERY)
        self._mirrored: list[SharedRequest] | None = None
        #: Requests refused at the door by a bound (for tests and the log).
        self.turned_away = 0

    # --- the requester's side (the HTTP endpoint) -------------------------------------

    def request(self, name: object, address: str, reached_at: tuple[str, int] = ("", 0)
                ) -> Enrolment:
        """Take a new request from `address`, made to the port at `reached_at` (its
        socket's own address and port number: the code is bound to both), or raise why
        not.  Every request that passes the rates takes its token, whatever then refuses
        it (an invalid or taken name too)."""
        now = self._clock()
        self._expire(now)
        bucket = self._bucket(address)
        wait = max(bucket.wait(now), self._port.wait(now))
        if wait > 0:
            self.turned_away += 1
            raise TooManyEnrolments("Too many enrolment requests; try again later.",
                                    retry_after=wait)
        bucket.take(now)
        self._port.take(now)
        name = _asked_name(name)
        if sum(1 for e in self._by_token.values() if e.address == address) >= MAX_PER_ADDRESS:
            self.turned_away += 1
            raise TooManyEnrolments("This address already has requests waiting for the "
                                    "owner; wait for them.", retry_after=self._next_expiry(now))
        if len(self._by_token) >= MAX_REQUESTS:
            self.turned_away += 1
            raise EnrolmentsFull("The owner has as many requests waiting as this port keeps; "
                                 "try again later.", retry_after=self._next_expiry(now))
        if self._taken(name):
            raise EnrolmentNameTaken(NAME_TAKEN, param="name")
        code = enrolment_code(address, *reached_at, name)
        enrolment = Enrolment(name=name, address=address, code=code, requested_at=now,
                              expires_at=now + self._ttl(), token=secrets.token_urlsafe(24))
        self._by_token[enrolment.token] = enrolment
        # In the file before the teammate is told its code: the owner, told that code,
        # lists the requests at once (`keys requests`), not at the next sync.
        self._mirror([])
        self._changed()
        return enrolment

    def find(self, token: str) -> Enrolment:
        """The request with id `token`; EnrolmentRefused (once) when the owner refused it,
        EnrolmentNotFound when expired, collected or unknown."""
        self._expire(self._clock())
        found = self._by_token.get(token) if isinstance(token, str) else None
        if found is not None:
            return found
        if isinstance(token, str) and self._refused.pop(token, None) is not None:
            raise EnrolmentRefused("The owner refused this enrolment request.")
        raise EnrolmentNotFound("No such enrolment request: it expired, was answered "
                                "already, or never was. Run gguf-studio connect again.")

    def seconds_left(self, enrolment: Enrolment) -> float:
        return enrolment.expires_in(self._clock())

    async def wait(self, token: str, timeout: float) -> Enrolment:
        """The request once approved, or as it is after `timeout` seconds (or at its
        expiry); raises as `find` does (a refusal while waiting too)."""
        enrolment = self.find(token)
        deadline = self._clock() + timeout
        while enrolment.state == PENDING:
            # Again while time is left: the loop's timer may fire a little before the
            # wall clock says the request expired.
            limit = min(deadline, enrolment.expires_at) - self._clock()
            if limit <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(enrolment.changed.wait(), limit)
            enrolment = self.find(token)
        return self.find(token)

    def collect(self, enrolment: Enrolment) -> tuple[KeyRecord, str]:
        """Make the approved request's key with the owner's limits and hand over its
        secret, once: the request is forgotten.  EnrolmentNotFound when it expired or was
        collected already; EnrolmentNotMade when the key cannot be made now."""
        self._expire(self._clock())
        if self._by_token.get(enrolment.token) is not enrolment or enrolment.state != APPROVED:
            raise EnrolmentNotFound("No such enrolment request: it expired, was answered "
                                    "already, or never was. Run gguf-studio connect again.")
        del self._by_token[enrolment.token]
        outcome = _outcome(enrolment)
        try:
            record, secret = self.keys.add(enrolment.name, **enrolment.limits)
        except KeyStoreError as exc:
            self._mirror([dict(outcome, result="failed", error=str(exc))])
            self._changed()
            raise EnrolmentNotMade(f"The owner approved this request, but its key could not "
                                   f"be made: {exc} Ask the owner.") from None
        self._mirror([dict(outcome, result="collected")])
        self._changed()
        return record, secret

    # --- the owner's side -----------------------------------------------------------------

    def pending(self) -> list[Enrolment]:
        """Requests waiting for the owner, oldest first."""
        self._expire(self._clock())
        return sorted((e for e in self._by_token.values() if e.state == PENDING),
                      key=lambda e: e.requested_at)

    def waiting(self) -> list[SharedRequest]:
        """The same as the owner sees them (no id)."""
        return [e.shared() for e in self.pending()]

    def approve(self, name: str, code: str, requested_at: float, **limits: Any) -> Enrolment:
        """Approve the pending request named `name` whose code is `code`, made at
        `requested_at` (what the owner checked), with `limits` as `keys add` takes them:
        its key is made when its requester collects it.  A limit the key could not have
        is refused now, and so is a name a key took meanwhile."""
        enrolment = self._checked(name, code, requested_at)
        self.keys.check_add(enrolment.name, **limits)
        enrolment.state, enrolment.limits = APPROVED, dict(limits)
        enrolment.changed.set()
        self._changed()
        return enrolment

    def refuse(self, name: str, code: str, requested_at: float) -> Enrolment:
        """Refuse the request the owner checked: its place is free at once; its
        requester learns the refusal on its next poll."""
        enrolment = self._checked(name, code, requested_at)
        del self._by_token[enrolment.token]
        enrolment.state = REFUSED
        self._refused[enrolment.token] = enrolment.expires_at
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)
        enrolment.changed.set()
        self._changed()
        return enrolment

    def sync(self) -> None:
        """Expire what is old, take the decisions other processes wrote, and mirror the
        pending requests into the file (only when they changed)."""
        self._expire(self._clock())
        try:
            outcomes = [self._take(decision) for decision in self.file.take_decisions()]
        except (OSError, StudioError) as exc:
            # Written anew by the mirror below; the command that wrote it hears why.
            outcomes = [{"name": "", "code": "", "result": "failed", "error": str(exc)}]
        self._mirror(outcomes)

    def close(self) -> None:
        """The port stops: nothing it held can be collected any more."""
        self._by_token.clear()
        self._refused.clear()
        with contextlib.suppress(OSError, StudioError):
            self.file.mirror([], [])

    # --- helpers -----------------------------------------------------------------------

    def _take(self, decision: Any) -> dict[str, Any]:
        """One decision another process wrote, taken; its outcome.  Only an explicit
        "approve" approves: anything unreadable fails."""
        if not isinstance(decision, dict):
            return {"name": "", "code": "", "result": "failed",
                    "error": "The decision is not readable."}
        asked_at = decision.get("requested_at")
        outcome = {"name": str(decision.get("name", ""))[:80],
                   "code": str(decision.get("code", ""))[:16],
                   "requested_at": asked_at if isinstance(asked_at, (int, float)) else None}
        try:
            name, code, requested_at = _named_request(decision)
            action = decision.get("action")
            if action == "approve":
                self.approve(name, code, requested_at, **_limits(decision.get("limits")))
                return dict(outcome, result=APPROVED)
            if action == "refuse":
                self.refuse(name, code, requested_at)
                return dict(outcome, result=REFUSED)
            raise ValueError(f"The decision's action {str(action)[:40]!r} is neither "
                             "'approve' nor 'refuse'.")
        except (StudioError, TypeError, ValueError) as exc:
            return dict(outcome, result="failed", error=str(exc))

    def _mirror(self, outcomes: list[dict[str, Any]]) -> None:
        """The pending requests into the file, for `keys requests` (when they changed)."""
        shared = self.waiting()
        if outcomes or shared != self._mirrored:
            with contextlib.suppress(OSError, StudioError):
                self.file.mirror(shared, outcomes)
                self._mirrored = shared

    def _checked(self, name: str, code: str, requested_at: float) -> Enrolment:
        """The pending request the owner checked, or a KeyStoreError saying why not."""
        self._expire(self._clock())
        for enrolment in self._by_token.values():
            if enrolment.state == PENDING and enrolment.is_the(name, code, requested_at):
                return enrolment
        if any(e.state == PENDING and e.name.casefold() == name.casefold()
               for e in self._by_token.values()):
            raise KeyStoreError(f"The request named {name!r} waiting now is not the one with "
                                f"code {code}: that one expired or was answered, and this one "
                                "was made since. Check its code with the person before "
                                "approving it.")
        raise KeyStoreError(f"No request named {name!r} with code {code} is waiting: it "
                            "expired or was answered (gguf-studio keys requests lists those "
                            "waiting).")

    def _taken(self, name: str) -> bool:
        folded = name.casefold()
        return (any(r.name.casefold() == folded for r in self.keys.records())
                or any(e.name.casefold() == folded for e in self._by_token.values()))

    def _expire(self, now: float) -> None:
        gone = [t for t, e in self._by_token.items() if e.expires_at <= now]
        for token in gone:
            enrolment = self._by_token.pop(token)
            enrolment.limits = {}
            enrolment.changed.set()
        for token in [t for t, expires_at in self._refused.items() if expires_at <= now]:
            del self._refused[token]
        if gone:
            self._changed()

    def _next_expiry(self, now: float) -> float:
        return min((e.expires_in(now) for e in self._by_token.values()), default=1.0) or 1.0

    def _bucket(self, address: str) -> _Bucket:
        bucket = self._addresses.pop(address, None) or _Bucket(PER_ADDRESS_BURST,
                                                                PER_ADDRESS_EVERY)
        self._addresses[address] = bucket
        while len(self._addresses) > MAX_ADDRESSES:
            self._addresses.popitem(last=False)
        return bucket

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()


class EnrolmentFile:
    """`enrolments.json`: the port's pending requests for other processes to read, and
    their decisions for the port to take."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # The file as this object last wrote or read it: `take_decisions` reads it only
        # when another process changed it since (the port looks twice a second).
        self._seen: tuple[int, ...] | None = None

    def requests(self, now: float | None = None) -> list[SharedRequest]:
        """The pending requests the port last wrote (expired ones left out)."""
        now = time.time() if now is None else now
        return [r for r in _shared(_read(self.path), self.path) if r.expires_at > now]

    def outcomes(self) -> list[dict[str, Any]]:
        return [o for o in _read(self.path)["outcomes"] if isinstance(o, dict)]

    def decide(self, code: str, action: str, limits: dict[str, Any] | None = None, *,
               name: str | None = None) -> SharedRequest:
        """Write the owner's decision on the pending request whose code is `code` (and,
        given, whose name is `name`) for the port to take: it names the request by its
        name, code and time asked."""
        assert action in ("approve", "refuse"), action
        with _locked(self.path):
            saved = _read(self.path)
            now = time.time()
            found = next((r for r in _shared(saved, self.path)
                          if r.code == code and r.expires_at > now), None)
            if found is None or (name is not None and found.name.casefold() != name.casefold()):
                whose = f"named {name!r} " if name is not None else ""
                raise KeyStoreError(f"No request {whose}with code {code} is waiting "
                                    "(gguf-studio keys requests lists them; unanswered ones "
                                    "expire, and only a running port takes them).")
            saved["decisions"] = [d for d in saved["decisions"]
                                  if not isinstance(d, dict) or d.get("code") != code]
            saved["decisions"].append({"name": found.name, "code": found.code,
                                       "requested_at": found.requested_at, "action": action,
                                       "limits": limits or {}})
            saved["outcomes"] = [o for o in saved["outcomes"]
                                 if isinstance(o, dict) and o.get("code") != code]
            _write(self.path, saved)
        return found

    def take_decisions(self) -> list[Any]:
        """The decisions written since, as written (the port checks each), removed."""
        seen = _signature(self.path)
        if seen is None or seen == self._seen:
            return []
        with _locked(self.path):
            saved = _read(self.path)
            decisions = list(saved["decisions"])
            if decisions:
                saved["decisions"] = []
                _write(self.path, saved)
            self._seen = _signature(self.path)
        return decisions

    def mirror(self, requests: list[SharedRequest], outcomes: list[dict[str, Any]]) -> None:
        """The port's pending requests and new outcomes into the file (which the port
        owns: one that does not hold enrolments is written anew)."""
        with _locked(self.path):
            try:
                saved = _read(self.path)
            except KeyStoreError:
                saved = _empty()
            saved["requests"] = [r.__dict__ for r in requests]
            saved["outcomes"] = (saved["outcomes"] + outcomes)[-MAX_OUTCOMES:]
            _write(self.path, saved)
            self._seen = _signature(self.path)


def enrolments_path() -> Path:
    """Beside the keys: private to the user like them."""
    return keys_path().with_name("enrolments.json")


# --- helpers -------------------------------------------------------------------------------


@dataclass
class _Bucket:
    """A token bucket: `burst` at once, then one per `every` seconds."""

    burst: int
    every: float
    tokens: float = math.nan
    at: float = 0.0

    def _refill(self, now: float) -> None:
        if math.isnan(self.tokens):
            self.tokens, self.at = float(self.burst), now
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) / self.every)
        self.at = now

    def wait(self, now: float) -> float:
        """Seconds until a token is there (0: now)."""
        self._refill(now)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) * self.every

    def take(self, now: float) -> None:
        self._refill(now)
        self.tokens -= 1


def _asked_name(name: object) -> str:
    """The name a requester sent, checked as a key's name."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequest("Send the name the key should have: {\"name\": \"alice\"}.",
                             param="name")
    name = name.strip()
    try:
        check_name(name)
    except KeyStoreError as exc:
        raise InvalidRequest(str(exc), param="name") from None
    return name


def _named_request(decision: dict[str, Any]) -> tuple[str, str, float]:
    """The request a decision names: its name, code and time asked (all three)."""
    name, code, requested_at = (decision.get(k) for k in ("name", "code", "requested_at"))
    if not isinstance(name, str) or not isinstance(code, str) or isinstance(
            requested_at, bool) or not isinstance(requested_at, (int, float)):
        raise ValueError("The decision does not name a request by its name, code and time "
                         "asked.")
    return name, code, float(requested_at)


def _outcome(enrolment: Enrolment) -> dict[str, Any]:
    return {"name": enrolment.name, "code": enrolment.code,
            "requested_at": enrolment.requested_at}


def _shared(saved: dict[str, Any], path: Path) -> list[SharedRequest]:
    try:
        return [SharedRequest(str(r["name"]), str(r["address"]), str(r["code"]),
                              float(r["requested_at"]), float(r["expires_at"]))
                for r in saved["requests"]]
    except (KeyError, TypeError, ValueError):
        raise KeyStoreError(f"The enrolment file {path.name} does not hold enrolments.") \
            from None


_LIMIT_FIELDS = {"models", "max_concurrent", "tokens_per_minute", "tokens_per_day", "priority",
                 "weight", "expires_at"}


def _limits(raw: Any) -> dict[str, Any]:
    """A decision's limits as KeyStore.add takes them (what another process wrote)."""
    if not isinstance(raw, dict) or set(raw) - _LIMIT_FIELDS:
        raise ValueError("The decision's limits are not readable.")
    limits = dict(raw)
    if "models" in limits:
        if not isinstance(limits["models"], list):
            raise ValueError("The decision's models are not a list.")
        limits["models"] = tuple(limits["models"])
    return limits


def _signature(path: Path) -> tuple[int, ...] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _empty() -> dict[str, Any]:
    return {"version": FILE_VERSION, "requests": [], "decisions": [], "outcomes": []}


def _read(path: Path) -> dict[str, Any]:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _empty()
    except (OSError, ValueError, UnicodeDecodeError):
        raise KeyStoreError(f"The enrolment file {path.name} is not readable.") from None
    if not isinstance(saved, dict) or saved.get("version") != FILE_VERSION or not all(
            isinstance(saved.get(k), list) for k in ("requests", "decisions", "outcomes")):
        raise KeyStoreError(f"The enrolment file {path.name} does not hold enrolments.")
    return saved


def _write(path: Path, saved: dict[str, Any]) -> None:
    write_private(path, (json.dumps(saved, indent=2) + "\n").encode())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Held while a process reads, changes and writes the file (a lock file beside it)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        try:
            import fcntl
        except ImportError:  # Windows: two processes at once may race
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
