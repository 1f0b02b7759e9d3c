"""Enrolment: a teammate asks the port for a key, the owner approves or refuses.

`gguf-studio connect` on the teammate's machine sends a name (`request`); the port
answers with a short code and a secret id only that requester learns.  The owner sees
the name, the requester's address and the same code in the window or in `gguf-studio
keys requests`, and approves it with limits (`approve`: a named key is minted in the key
store, as `keys add` makes one) or refuses it.  The requester polls with its id
(`wait`/`collect`) and receives the key's secret **once**: it is handed over and
forgotten, and never written to disk here.

**Bounded.**  At most `MAX_REQUESTS` requests are kept (pending, or decided and not yet
collected); each expires `ttl` seconds after it was made (600 by default) and is then
forgotten, approved or not: an approval that was never collected leaves its key unused,
and an expired request mints nothing.  New requests are rate-limited per client address
(`PER_ADDRESS_BURST`, then one per `PER_ADDRESS_EVERY` seconds; at most
`MAX_PER_ADDRESS` waiting at once; `MAX_ADDRESSES` addresses remembered) and for the whole
port (`PORT_BURST`, then one per `PORT_EVERY` seconds).  Past any bound the answer is a
429 with Retry-After, and the state stays as it was.

**Across processes.**  The port mirrors its pending requests (name, address, code,
times; never the id) into `enrolments.json` beside the keys (0600, written under a lock),
where `gguf-studio keys requests|approve|refuse` in another process reads them and
writes its decision (`EnrolmentFile.decide`); the port takes decisions on its next
`sync` (twice a second), mints the key itself, and notes the outcome for the command to
read.  So a secret only ever exists in the port's memory and on the wire to its
requester.
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

from backend.errors import (EnrolmentNameTaken, EnrolmentNotFound, EnrolmentRefused,
                            EnrolmentsFull, InvalidRequest, KeyStoreError, StudioError,
                            TooManyEnrolments)
from backend.key_store import KeyRecord, KeyStore, check_name, keys_path
from backend.private_files import PRIVATE_FILE_MODE, write_private

__all__ = [
    "DEFAULT_TTL",
    "MAX_REQUESTS",
    "Enrolment",
    "EnrolmentFile",
    "Enrolments",
    "SharedRequest",
    "enrolments_path",
]

#: Requests kept at once, pending or decided and not yet collected.
MAX_REQUESTS = 8
#: Seconds a request waits for the owner before it expires (and is forgotten).
DEFAULT_TTL = 600.0
#: New requests one address may make at once, then one per PER_ADDRESS_EVERY seconds.
PER_ADDRESS_BURST = 3
PER_ADDRESS_EVERY = 20.0
#: Requests of one address waiting at once.
MAX_PER_ADDRESS = 2
#: Addresses whose rate is remembered; the least recently seen are forgotten first.
MAX_ADDRESSES = 256
#: New requests the port takes at once from everyone, then one per PORT_EVERY seconds.
PORT_BURST = 10
PORT_EVERY = 6.0
#: Outcomes (approved, refused, failed) kept in the file for `keys approve` to read.
MAX_OUTCOMES = 16
#: The short code's letters: no 0/O, 1/I/L, so it reads aloud and types without doubt.
CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"
FILE_VERSION = 1

PENDING, APPROVED, REFUSED = "pending", "approved", "refused"


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
    record: KeyRecord | None = None  # the key minted on approval
    secret: str = ""  # its secret, until the requester collects it
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def expires_in(self, now: float) -> float:
        return max(0.0, self.expires_at - now)


@dataclass(frozen=True)
class SharedRequest:
    """A pending request as `enrolments.json` shows it to other processes."""

    name: str
    address: str
    code: str
    requested_at: float
    expires_at: float


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
        self._addresses: OrderedDict[str, _Bucket] = OrderedDict()
        self._port = _Bucket(PORT_BURST, PORT_EVERY)
        self._mirrored: list[SharedRequest] | None = None
        #: Requests refused at the door by a bound (for tests and the log).
        self.turned_away = 0

    # --- the requester's side (the HTTP endpoint) -------------------------------------

    def request(self, name: str, address: str) -> Enrolment:
        """Take a new request, or raise why not (a 429 leaves the state as it was)."""
        now = self._clock()
        self._expire(now)
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest("Send the name the key should have: {\"name\": \"alice\"}.",
                                 param="name")
        name = name.strip()
        try:
            check_name(name)
        except KeyStoreError as exc:
            raise InvalidRequest(str(exc), param="name") from None
        bucket = self._bucket(address)
        wait = max(bucket.wait(now), self._port.wait(now))
        if wait > 0:
            self.turned_away += 1
            raise TooManyEnrolments("Too many enrolment requests; try again later.",
                                    retry_after=wait)
        if sum(1 for e in self._by_token.values() if e.address == address) >= MAX_PER_ADDRESS:
            self.turned_away += 1
            raise TooManyEnrolments("This address already has requests waiting for the "
                                    "owner; wait for them.", retry_after=self._next_expiry(now))
        if len(self._by_token) >= MAX_REQUESTS:
            self.turned_away += 1
            raise EnrolmentsFull("The owner has as many requests waiting as this port keeps; "
                                 "try again later.", retry_after=self._next_expiry(now))
        folded = name.casefold()
        if self.keys.get(name) is not None or any(
                r.name.casefold() == folded for r in self.keys.records()):
            raise EnrolmentNameTaken(f"A key named {name!r} exists already; choose another "
                                     "name.", param="name")
        if any(e.name.casefold() == folded for e in self._by_token.values()):
            raise EnrolmentNameTaken(f"A request named {name!r} is waiting already; choose "
                                     "another name.", param="name")
        bucket.take(now)
        self._port.take(now)
        enrolment = Enrolment(name=name, address=address, code=_new_code(), requested_at=now,
                              expires_at=now + self._ttl(), token=secrets.token_urlsafe(24))
        self._by_token[enrolment.token] = enrolment
        # In the file before the teammate is told its code: the owner, told that code,
        # lists the requests at once (`keys requests`), not at the next sync.
        self._mirror([])
        self._changed()
        return enrolment

    def find(self, token: str) -> Enrolment:
        """The request with id `token`; EnrolmentNotFound when expired, collected or unknown."""
        self._expire(self._clock())
        found = self._by_token.get(token) if isinstance(token, str) else None
        if found is None:
            raise EnrolmentNotFound("No such enrolment request: it expired, was answered "
                                    "already, or never was. Run gguf-studio connect again.")
        return found

    def seconds_left(self, enrolment: Enrolment) -> float:
        return enrolment.expires_in(self._clock())

    async def wait(self, token: str, timeout: float) -> Enrolment:
        """The request once decided, or as it is after `timeout` seconds (or at its expiry)."""
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

    def collect(self, enrolment: Enrolment) -> str:
        """The approved key's secret, handed over once: the request is forgotten.  A
        refused request raises its refusal (once, too)."""
        if enrolment.state == REFUSED:
            self._by_token.pop(enrolment.token, None)
            self._changed()
            raise EnrolmentRefused("The owner refused this enrolment request.")
        assert enrolment.state == APPROVED, enrolment.state
        secret, enrolment.secret = enrolment.secret, ""
        self._by_token.pop(enrolment.token, None)
        self._changed()
        return secret

    # --- the owner's side -----------------------------------------------------------------

    def pending(self) -> list[Enrolment]:
        """Requests waiting for the owner, oldest first."""
        self._expire(self._clock())
        return sorted((e for e in self._by_token.values() if e.state == PENDING),
                      key=lambda e: e.requested_at)

    def approve(self, name: str, **limits: Any) -> KeyRecord:
        """Mint the key of the pending request `name` (with `limits`, as `keys add`
        takes them) for its requester to collect."""
        enrolment = self._pending_named(name)
        record, secret = self.keys.add(enrolment.name, **limits)
        enrolment.state, enrolment.record, enrolment.secret = APPROVED, record, secret
        enrolment.changed.set()
        self._changed()
        return record

    def refuse(self, name: str) -> Enrolment:
        enrolment = self._pending_named(name)
        enrolment.state = REFUSED
        enrolment.changed.set()
        self._changed()
        return enrolment

    def sync(self) -> None:
        """Expire what is old, take the decisions other processes wrote, and mirror the
        pending requests into the file (only when they changed)."""
        self._expire(self._clock())
        try:
            decisions = self.file.take_decisions()
        except (OSError, StudioError):
            decisions = []
        outcomes = []
        for decision in decisions:
            name = str(decision.get("name", ""))
            try:
                if decision.get("action") == "refuse":
                    self.refuse(name)
                    outcomes.append({"name": name, "result": REFUSED})
                else:
                    record = self.approve(name, **_limits(decision.get("limits")))
                    outcomes.append({"name": record.name, "result": APPROVED})
            except (StudioError, TypeError, ValueError) as exc:
                outcomes.append({"name": name, "result": "failed", "error": str(exc)})
        self._mirror(outcomes)

    def close(self) -> None:
        """The port stops: nothing it held can be collected any more."""
        self._by_token.clear()
        with contextlib.suppress(OSError, StudioError):
            self.file.mirror([], [])

    # --- helpers -----------------------------------------------------------------------

    def _mirror(self, outcomes: list[dict[str, Any]]) -> None:
        """The pending requests into the file, for `keys requests` (when they changed)."""
        shared = [SharedRequest(e.name, e.address, e.code, e.requested_at, e.expires_at)
                  for e in self.pending()]
        if outcomes or shared != self._mirrored:
            with contextlib.suppress(OSError, StudioError):
                self.file.mirror(shared, outcomes)
                self._mirrored = shared

    def _pending_named(self, name: str) -> Enrolment:
        self._expire(self._clock())
        folded = name.casefold()
        for enrolment in self._by_token.values():
            if enrolment.name.casefold() == folded and enrolment.state == PENDING:
                return enrolment
        raise KeyStoreError(f"No enrolment request named {name!r} is waiting (gguf-studio "
                            "keys requests lists them; unanswered ones expire).")

    def _expire(self, now: float) -> None:
        gone = [t for t, e in self._by_token.items() if e.expires_at <= now]
        for token in gone:
            enrolment = self._by_token.pop(token)
            enrolment.secret = ""
            enrolment.changed.set()
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
        saved = _read(self.path)
        return [SharedRequest(str(r["name"]), str(r["address"]), str(r["code"]),
                              float(r["requested_at"]), float(r["expires_at"]))
                for r in saved["requests"] if float(r["expires_at"]) > now]

    def outcomes(self) -> list[dict[str, Any]]:
        return list(_read(self.path)["outcomes"])

    def decide(self, name: str, action: str, limits: dict[str, Any] | None = None) -> SharedRequest:
        """Write the owner's decision on the pending request `name` for the port to take."""
        with _locked(self.path):
            saved = _read(self.path)
            folded = name.casefold()
            now = time.time()
            found = next((r for r in saved["requests"] if str(r["name"]).casefold() == folded
                          and float(r["expires_at"]) > now), None)
            if found is None:
                raise KeyStoreError(f"No enrolment request named {name!r} is waiting (gguf-studio "
                                    "keys requests lists them; unanswered ones expire, and "
                                    "only a running port takes them).")
            saved["decisions"] = [d for d in saved["decisions"]
                                  if str(d.get("name", "")).casefold() != folded]
            saved["decisions"].append({"name": found["name"], "action": action,
                                       "limits": limits or {}})
            saved["outcomes"] = [o for o in saved["outcomes"]
                                 if str(o.get("name", "")).casefold() != folded]
            _write(self.path, saved)
        return SharedRequest(str(found["name"]), str(found["address"]), str(found["code"]),
                             float(found["requested_at"]), float(found["expires_at"]))

    def take_decisions(self) -> list[dict[str, Any]]:
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
        with _locked(self.path):
            saved = _read(self.path)
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


def _new_code() -> str:
    letters = "".join(secrets.choice(CODE_ALPHABET) for _ in range(6))
    return f"{letters[:3]}-{letters[3:]}"


_LIMIT_FIELDS = {"models", "max_concurrent", "tokens_per_minute", "tokens_per_day", "priority",
                 "weight", "expires_at"}


def _limits(raw: Any) -> dict[str, Any]:
    """A decision's limits as KeyStore.add takes them (what another process wrote)."""
    if not isinstance(raw, dict) or set(raw) - _LIMIT_FIELDS:
        raise ValueError("The decision's limits are not readable.")
    limits = dict(raw)
    if "models" in limits:
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
