"""Named API keys: who may use the port, which models, how much, how urgently.

A key is a name with limits: the models it may use (none listed = all), how many of its
requests may run at once, tokens per minute and per day, a priority band and a weight
for its share of the engine, an expiry date, and whether it was revoked.  Today's single
key (`settings.api_key`) stays the owner's key: all models, no limits (`OWNER`).

**No secret is stored.**  A secret is `gs-` + 32 random bytes (256 bits, made by
`backend.api_keys.generate_api_key`) and is shown once, when the key is made; the store
keeps its SHA-256.  A plain, unsalted SHA-256 is enough here: slow salted hashes (bcrypt,
argon2) exist because people choose guessable passwords, and make each guess expensive;
a 256-bit random secret cannot be guessed however fast the hash is, so slowness would
only cost every request milliseconds.  Without a salt the digest is also an index:
`authenticate` looks the digest up in a dict (O(1), however many keys) and then compares
it in constant time.  The lookup's own timing can at most reveal something about a
digest, and SHA-256 being preimage-resistant, knowing a digest does not help find a
secret that has it.

The file (`keys.json`, next to settings.json) is private like the settings (0600 in a
0700 directory, repaired on load) and written atomically under a lock, so that the
window and `gguf-studio keys ...` may change keys at the same time without losing one
another's change.  **Changes apply live**: a store re-reads the file when its identity
(inode, size, times) changed, looking at most every `check_interval` seconds, so a
running port sees `keys add/edit/revoke` made by another process within that time; on
the hot path that costs one clock read, and a `stat` twice a second.  A revocation
always changes the file's size, so it is never missed.

When a key was last used, and everything else that changes per request, lives in the
usage ledger (backend.keys.usage): writing this file per request would put disk I/O on
the hot path and race with people editing keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fnmatch
import hashlib
import hmac
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import platformdirs

from backend.api_keys import generate_api_key
from backend.errors import KeyExpired, KeyRevoked, KeyStoreError, SettingsError, Unauthorized
from backend.keys.expiry import check_future, describe_time
from backend.private_files import PRIVATE_FILE_MODE, make_private, write_private
from backend.settings import APP_NAME

__all__ = [
    "CHECK_INTERVAL",
    "EDITABLE",
    "CHAT_NAME",
    "OWNER",
    "OWNER_CHAT",
    "OWNER_NAME",
    "KeyRecord",
    "KeyStore",
    "Priority",
    "check_name",
    "hash_secret",
    "keys_path",
]

log = logging.getLogger("gguf_studio.keys")

OWNER_NAME = "owner"
FILE_VERSION = 1
#: Seconds between two looks at the file for changes made by another process.
CHECK_INTERVAL = 0.5
MAX_NAME_LENGTH = 64
#: The largest limit a key may have: every count stays exact as a float (2**53).
MAX_LIMIT = 2**53
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]*")


class Priority(enum.StrEnum):
    """A key's band: interactive requests go before normal ones, normal before batch."""

    INTERACTIVE = "interactive"
    NORMAL = "normal"
    BATCH = "batch"


@dataclass(frozen=True)
class KeyRecord:
    """One key: its name, the digest of its secret, its limits and its state.

    None for a limit means no limit.  Times are seconds since the epoch (UTC)."""

    name: str
    secret_hash: str = ""
    models: tuple[str, ...] = ()
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    priority: Priority = Priority.NORMAL
    weight: float = 1.0
    expires_at: float | None = None
    revoked_at: float | None = None
    created_at: float = 0.0

    @property
    def is_owner(self) -> bool:
        """The owner's key, or the window's Chat tab (the owner's own client)."""
        return self.name in (OWNER_NAME, CHAT_NAME)

    def allows(self, model: str) -> bool:
        """Whether this key may use `model`: any when none are listed; else a listed
        name, exactly or by a shell-style pattern ("qwen*")."""
        return not self.models or any(fnmatch.fnmatchcase(model, allowed)
                                      for allowed in self.models)

    def status(self, now: float) -> str:
        """"revoked", "expired" or "active"."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return "active"

    def refusal(self, now: float) -> Unauthorized | None:
        """The 401 for a revoked or expired key, None for a usable one.  Also for
        requests already waiting in line: admission asks again when the store changes."""
        status = self.status(now)
        if status == "revoked":
            assert self.revoked_at is not None
            return KeyRevoked(f"The API key {self.name!r} was revoked on "
                              f"{describe_time(self.revoked_at)}; ask the server's owner "
                              "for a new key.")
        if status == "expired":
            assert self.expires_at is not None
            return KeyExpired(f"The API key {self.name!r} expired on "
                              f"{describe_time(self.expires_at)}; ask the server's owner "
                              "to extend it.")
        return None


#: Today's single key (settings.api_key): every model, no limits.
OWNER = KeyRecord(name=OWNER_NAME)
#: The window's Chat tab: the owner's, with a flow and usage of its own (a name no named
#: key can take: it has a space).  Its secret lives in the running app only.
CHAT_NAME = "chat tab"
OWNER_CHAT = KeyRecord(name=CHAT_NAME)

#: What `KeyStore.edit` may change.
EDITABLE = frozenset({"models", "max_concurrent", "tokens_per_minute", "tokens_per_day",
                      "priority", "weight", "expires_at"})


def keys_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "keys.json"


def hash_secret(secret: str) -> str:
    """The hex SHA-256 of a secret (why that suffices: this module's docstring)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


class KeyStore:
    """The named keys of this user, read from `path` and kept current with it."""

    def __init__(self, path: Path | None = None, *, owner_secret: str = "",
                 check_interval: float = CHECK_INTERVAL,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 keys_required: bool = False,
                 on_keys_required: Callable[[], None] | None = None) -> None:
        """`keys_required`: named keys were used before (`requires_keys`);
        `on_keys_required()` is called when the first named key is seen, to keep that."""
        self.path = path or keys_path()
        self.keys_required = keys_required
        self._on_keys_required = on_keys_required
        self._warned_empty = False
        self.check_interval = check_interval
        self._clock = clock
        self._wall_clock = wall_clock
        self._owner_hash = ""
        self.set_owner_secret(owner_secret)
        self._records: dict[str, KeyRecord] = {}
        self._by_hash: dict[str, KeyRecord] = {}
        self._signature: tuple[int, ...] | None = None
        self._next_check = -math.inf
        #: Goes up by one whenever the keys seen change (admission re-checks waiters).
        self.generation = 0
        make_private(self.path)
        self.refresh(force=True)

    # --- the hot path ------------------------------------------------------------------

    def set_owner_secret(self, secret: str) -> None:
        """The owner's key (settings.api_key), "" for none; set again whenever it changes.
        Only its digest is kept."""
        self._owner_hash = hash_secret(secret) if secret else ""

    def authenticate(self, secret: str) -> KeyRecord | None:
        """The key whose secret `secret` is (`OWNER` for the owner's), None for no key.
        Raises KeyRevoked or KeyExpired (401) for a key that exists but may not be used."""
        if not secret:
            return None
        self._check_file()
        digest = hash_secret(secret)
        if self._owner_hash and hmac.compare_digest(self._owner_hash, digest):
            return OWNER
        record = self._by_hash.get(digest)
        if record is None and self.refresh():  # a key made a moment ago works at once
            record = self._by_hash.get(digest)
        if record is None or not hmac.compare_digest(record.secret_hash, digest):
            return None
        refusal = record.refusal(self._wall_clock())
        if refusal is not None:
            raise refusal
        return record

    def get(self, name: str) -> KeyRecord | None:
        """The key called `name` as it is now (`OWNER` for "owner"), None if there is none
        (a key deleted from the file by hand: treat its waiting requests as revoked)."""
        if name == OWNER_NAME:
            return OWNER
        self._check_file()
        return self._records.get(name)

    def requires_keys(self) -> bool:
        """Whether every request must send a key because of named keys: some exist now,
        or some existed on this port (`keys_required`, kept in the settings), so that a
        deleted or emptied keys file refuses everyone rather than letting everyone in."""
        if self.has_named_keys():
            return True
        if self.keys_required and not self._warned_empty:
            self._warned_empty = True
            log.warning("The keys file %s holds no keys, but named keys were used on this port: "
                        "every request needs a key (the owner's or a named one). Make a key with "
                        "`gguf-studio keys add`, or set keys_required to false in the settings "
                        "to serve without keys again.", self.path.name)
        return self.keys_required

    def has_named_keys(self) -> bool:
        """Whether any named key exists (revoked ones too): then every request needs one,
        and each key is its own flow."""
        self._check_file()
        if not self._records:
            self.refresh()  # the first key, made a moment ago, applies at once
        return bool(self._records)

    def records(self) -> list[KeyRecord]:
        """Every named key (revoked ones too), oldest first."""
        self._check_file()
        return sorted(self._records.values(), key=lambda r: (r.created_at, r.name))

    def refresh(self, force: bool = False) -> bool:
        """Re-read the file if it changed (always when `force`); True if the keys did.
        A file that turns unreadable while serving leaves the last good keys in use."""
        self._next_check = self._clock() + self.check_interval
        signature = _signature(self.path)
        if not force and signature == self._signature:
            return False
        try:
            records = _read(self.path)
        except KeyStoreError as exc:
            if force:
                raise
            if signature != self._signature:
                log.error("%s Keeping the keys read before.", exc)
            self._signature = signature
            return False
        self._signature = signature
        return self._install(records)

    # --- changes (the command line, the window) ------------------------------------------

    def add(self, name: str, *, models: tuple[str, ...] = (),
            max_concurrent: int | None = None, tokens_per_minute: int | None = None,
            tokens_per_day: int | None = None, priority: Priority = Priority.NORMAL,
            weight: float = 1.0, expires_at: float | None = None) -> tuple[KeyRecord, str]:
        """Make a key; returns it and its secret, which exists nowhere else afterwards."""
        secret = generate_api_key()
        record = self._new_record(name, hash_secret(secret), models=models,
                                  max_concurrent=max_concurrent,
                                  tokens_per_minute=tokens_per_minute,
                                  tokens_per_day=tokens_per_day, priority=priority,
                                  weight=weight, expires_at=expires_at)
        with self._changing() as records:
            _check_free(records, name)
            records[name] = record
        return record, secret

    def check_add(self, name: str, **limits: Any) -> None:
        """Raise the KeyStoreError `add(name, **limits)` would raise now, changing nothing
        (an approved enrolment's key is made later, when its requester collects it)."""
        unknown = set(limits) - EDITABLE
        if unknown:
            raise KeyStoreError(f"Not a key's limit: {', '.join(sorted(unknown))}.")
        self._new_record(name, "", **limits)
        self.refresh()
        _check_free(self._records, name)

    def _new_record(self, name: str, secret_hash: str, *, models: tuple[str, ...] = (),
                    max_concurrent: int | None = None, tokens_per_minute: int | None = None,
                    tokens_per_day: int | None = None, priority: Priority = Priority.NORMAL,
                    weight: float = 1.0, expires_at: float | None = None) -> KeyRecord:
        check_name(name)
        now = self._wall_clock()
        record = KeyRecord(name=name, secret_hash=secret_hash, models=tuple(models),
                           max_concurrent=max_concurrent, tokens_per_minute=tokens_per_minute,
                           tokens_per_day=tokens_per_day, priority=_priority(priority),
                           weight=weight, expires_at=_second(expires_at),
                           created_at=float(math.floor(now)))
        _check_limits(record)
        check_future(expires_at, now)
        return record

    def edit(self, name: str, **changes: Any) -> KeyRecord:
        """Change some of a key's limits (`EDITABLE`); the others stay as they are."""
        unknown = set(changes) - EDITABLE
        if unknown:
            raise KeyStoreError(f"A key has no setting {sorted(unknown)[0]!r} to change.")
        if "priority" in changes:
            changes["priority"] = _priority(changes["priority"])
        if "models" in changes:
            changes["models"] = tuple(changes["models"])
        if "expires_at" in changes:
            changes["expires_at"] = _second(changes["expires_at"])
        now = self._wall_clock()
        check_future(changes.get("expires_at"), now)
        with self._changing() as records:
            record = _existing(records, name)
            if record.revoked_at is not None:
                raise KeyStoreError(f"The key {name!r} is revoked and stays so; make a new "
                                    "key instead.")
            record = dataclasses.replace(record, **changes)
            _check_limits(record)
            records[record.name] = record
        return record

    def revoke(self, name: str) -> KeyRecord:
        """Revoke a key for good: its requests get 401 from now on, waiting ones too."""
        with self._changing() as records:
            record = _existing(records, name)
            if record.revoked_at is None:
                record = records[record.name] = dataclasses.replace(
                    record, revoked_at=_second(self._wall_clock()))
        return record

    # --- helpers -----------------------------------------------------------------------

    def _check_file(self) -> None:
        if self._clock() >= self._next_check:
            self.refresh()

    def _install(self, records: dict[str, KeyRecord]) -> bool:
        if records and not self.keys_required:
            self.keys_required = True
            if self._on_keys_required is not None:
                try:
                    self._on_keys_required()
                except (OSError, SettingsError) as exc:
                    log.error("Could not note in the settings that named keys are used: %s", exc)
        self._warned_empty = self._warned_empty and not records
        if records == self._records:
            return False
        self._records = records
        self._by_hash = {r.secret_hash: r for r in records.values()}
        self.generation += 1
        return True

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, KeyRecord]]:
        """Read the file afresh under the lock, let the caller change the keys, write."""
        with _file_lock(self.path):
            records = _read(self.path)
            yield records
            write_private(self.path, _dump(records))
            self._signature = _signature(self.path)
            self._next_check = self._clock() + self.check_interval
            self._install(records)


# --- the file --------------------------------------------------------------------------


def _signature(path: Path) -> tuple[int, ...] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _read(path: Path) -> dict[str, KeyRecord]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "not readable text"
        raise KeyStoreError(f"The keys file {path.name} cannot be read ({reason}).") from None
    try:
        saved = json.loads(text)
    except ValueError as exc:
        raise KeyStoreError(f"The keys file {path.name} is not readable JSON: {exc}") from None
    except RecursionError:  # a hand-edited file nested thousands deep
        raise KeyStoreError(f"The keys file {path.name} is not readable JSON: it is nested "
                            "too deep.") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("keys"), list):
        raise KeyStoreError(f"The keys file {path.name} does not hold keys.")
    if saved.get("version") != FILE_VERSION:
        raise KeyStoreError(f"The keys file {path.name} was written by another version of "
                            f"GGUF Studio (format {saved.get('version')!r}).")
    records: dict[str, KeyRecord] = {}
    for entry in saved["keys"]:
        record = _from_json(entry, path)
        records[record.name] = record
    return records


def _dump(records: dict[str, KeyRecord]) -> bytes:
    keys = [_to_json(r) for r in sorted(records.values(), key=lambda r: (r.created_at, r.name))]
    return (json.dumps({"version": FILE_VERSION, "keys": keys}, indent=2) + "\n").encode()


def _to_json(record: KeyRecord) -> dict[str, Any]:
    return {
        "name": record.name,
        "secret_sha256": record.secret_hash,
        "models": list(record.models),
        "max_concurrent": record.max_concurrent,
        "tokens_per_minute": record.tokens_per_minute,
        "tokens_per_day": record.tokens_per_day,
        "priority": record.priority.value,
        "weight": record.weight,
        "expires": _iso(record.expires_at),
        "revoked": _iso(record.revoked_at),
        "created": _iso(record.created_at),
    }


def _from_json(entry: Any, path: Path) -> KeyRecord:
    name = entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str):
        raise KeyStoreError(f"The keys file {path.name} holds an entry without a name.")
    try:
        digest = entry["secret_sha256"]
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError("secret_sha256")
        models = entry.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ValueError("models")
        record = KeyRecord(
            name=name, secret_hash=digest, models=tuple(models),
            max_concurrent=_optional_int(entry.get("max_concurrent")),
            tokens_per_minute=_optional_int(entry.get("tokens_per_minute")),
            tokens_per_day=_optional_int(entry.get("tokens_per_day")),
            priority=Priority(entry.get("priority", Priority.NORMAL.value)),
            weight=float(entry.get("weight", 1.0)),
            expires_at=_epoch(entry.get("expires")), revoked_at=_epoch(entry.get("revoked")),
            created_at=_epoch(entry.get("created")) or 0.0)
        _check_limits(record)
    except (KeyError, TypeError, ValueError, OverflowError, SettingsError):
        # OverflowError: a number too large for a float (a weight of 10**400).
        raise KeyStoreError(f"The key {name[:80]!r} in {path.name} has an unusable "
                            "setting.") from None
    return record


def _optional_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(value)


def _second(when: float | None) -> float | None:
    """`when` to the whole second the file keeps, so that a record reads back equal."""
    return None if when is None else float(math.floor(when))


def _iso(when: float | None) -> str | None:
    if when is None:
        return None
    return datetime.fromtimestamp(when, timezone.utc).isoformat(timespec="seconds")


def _epoch(text: Any) -> float | None:
    if text is None:
        return None
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(text)
    return moment.timestamp()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Held while a process reads, changes and writes the keys (a lock file beside it,
    since the keys file itself is replaced on every write)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        try:
            import fcntl
        except ImportError:  # Windows: changes from two processes at once may race
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# --- checks ----------------------------------------------------------------------------


def check_name(name: str) -> None:
    """Raise KeyStoreError for a name no key may have (the owner's, or odd characters)."""
    if name.casefold() == OWNER_NAME:
        raise KeyStoreError(f"{OWNER_NAME!r} is the name of the owner's key (the one in the "
                            "settings); choose another name.")
    if len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name):
        raise KeyStoreError(f"The key name {name!r} is not usable: use up to "
                            f"{MAX_NAME_LENGTH} letters, digits and . _ @ -, starting with a "
                            "letter or digit.")


def _check_limits(record: KeyRecord) -> None:
    for what, value in (("max concurrent", record.max_concurrent),
                        ("tokens per minute", record.tokens_per_minute),
                        ("tokens per day", record.tokens_per_day)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= MAX_LIMIT):
            shown = value if not isinstance(value, int) or abs(value) <= MAX_LIMIT else "a larger one"
            raise KeyStoreError(f"The key's {what} must be a whole number from 1 to {MAX_LIMIT:,} "
                                f"(or no limit), not {shown!r}.")
    if isinstance(record.weight, bool) or not isinstance(record.weight, (int, float)) \
            or not math.isfinite(record.weight) or record.weight <= 0:
        raise KeyStoreError(f"The key's weight must be a number above 0, not {record.weight!r}.")
    if any(not isinstance(m, str) or not m.strip() for m in record.models):
        raise KeyStoreError("A model name in the key's list is empty.")
    if not isinstance(record.priority, Priority):
        raise KeyStoreError(f"The key's priority must be one of "
                            f"{', '.join(p.value for p in Priority)}.")


def _priority(value: Any) -> Priority:
    try:
        return Priority(value)
    except ValueError:
        raise KeyStoreError(f"The priority {value!r} is not one of "
                            f"{', '.join(p.value for p in Priority)}.") from None


def _check_free(records: dict[str, KeyRecord], name: str) -> None:
    same = [r for r in records if r.casefold() == name.casefold()]
    if same:
        state = " (revoked)" if records[same[0]].revoked_at is not None else ""
        raise KeyStoreError(f"A key named {same[0]!r} already exists{state}; "
                            "choose another name.")


def _existing(records: dict[str, KeyRecord], name: str) -> KeyRecord:
    if name.casefold() == OWNER_NAME:
        raise KeyStoreError("The owner's key is the one in the settings and has no limits; "
                            "change it in the settings.")
    record = records.get(name) or next(
        (r for r in records.values() if r.name.casefold() == name.casefold()), None)
    if record is None:
        raise KeyStoreError(f"There is no key named {name!r} (gguf-studio keys list shows "
                            "them).")
    return record
