"""Parked slots: a session's prefix kept on disk while its engine is gone.

llama-server saves one slot's KV cache and tokens to a file in the directory it was
started with (`--slot-save-path`) and loads such a file back into a slot
(`POST /slots/{id}?action=save|restore`, body `{"filename": ...}`).  `ParkingLot` owns
that directory: 0700, each file 0600, bounded by a disk budget with the least recently
used file evicted first, and a small private index beside the files (`index.json`) that
survives a restart of the app and says, for each file, which model, key (flow) and
session it holds.

A parked file is a prompt at rest (its tokens are the conversation's text), so it lives
no longer than it serves: one unused (neither saved nor restored) for the lot's TTL
(`settings.parked_slots_days`, a week by default) is removed, when the lot opens and on
every later look; the files of a key that was revoked or deleted are removed with it
(`keep_flows`).  Before a save the slot's size is known (its tokens, from the engine's
`/slots`, times a token's bytes in this model's files: learnt from the files saved
before, else estimated from the model's header): a slot larger than the whole budget,
or one that would leave the disk with less than `MIN_FREE_DISK_BYTES` free, is not
saved, and older files make room within the budget before the engine writes.

A file's name is a digest of the three: it carries neither a secret nor a session's own
name, and a request of one key can never name another key's file.  A restore looks the
file up by the requesting key's own `ParkKey` and checks the index's key digest again
before the engine is asked to read it.

A restore may fail (a file of another model or cache layout, a prompt longer than the
slot): the engine then answers an error and clears the slot, and the request is served
with a plain prefill.  A file cut short or changed on disk never reaches the engine: the
pinned llama.cpp aborts on a truncated one (`GGML_ASSERT(nread <= state_size)`), so each
file's size and SHA-256 are kept in the index and checked before a restore.  A restore
may also answer success and not take (llama.cpp has had restores that were no-ops):
`Restored.took(cache_n)` tells from the next reply's cached tokens, and the file is
dropped when it did not.

A file is restored only into a turn that continues the prompt it holds: the index keeps
the parked prompt's length and a digest of its text (`Parked.continued_by`), the same in
every process.  A session's name comes again with another conversation (an agent run
again under the same ids, a title request, a fixed session header): restoring its older
prefix there would cost a plain prefill at best, and on a model whose memory cannot be
rolled back (a sliding window, a recurrent state) the engine keeps that stale prefix in
its RAM prompt cache, where the session's next turns find it instead of their own.

On such a model the engine rolls a restored prefix back to where the next turn parts
from it only through the slot's context checkpoints, which the pinned llama-server keeps
in the file only with our patch (`backend.llama.patches`): its save and restore answers
then say how many (`n_checkpoints`), and `SlotClient.parks_checkpoints` asks an engine
whether it does.

A prefix that llama-server moved from its slot to its RAM prompt cache (another prompt
took the slot) cannot be saved from there: `SlotClient.recall` sends its request again,
pinned to a slot that holds a prompt, for one token, and the engine loads it from that
cache into the slot, which is then saved like any other (`backend.app.pool.parking_steward`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from backend.llama.slot_actions import SlotActionFailed, SlotClient
from backend.private_files import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, make_private, write_private

__all__ = ["DEFAULT_BUDGET_BYTES", "DEFAULT_TTL_SECONDS", "INDEX_NAME",
           "MIN_FREE_DISK_BYTES", "ParkKey", "Parked", "ParkingLot", "Restored",
           "model_identity", "prompt_digest"]

log = logging.getLogger("gguf_studio.slot_parking")

#: Disk the parked slots may take together.  A slot of SmolLM2-135M holds about 22 KiB
#: per token (f16 KV), one of a 7B model about 128 KiB: 4 GiB keeps a few dozen
#: agent-sized prefixes (30k tokens) of a small model or a handful of a 7B one, and is
#: a small share of a disk that holds GGUF files.
DEFAULT_BUDGET_BYTES = 4 << 30
#: How long a parked prefix is kept unused (neither saved nor restored): a week, so that
#: a weekend away from an agent finds its prompt, and no prompt stays on disk for good.
DEFAULT_TTL_SECONDS = 7 * 24 * 3600.0
#: Free disk a save must leave: parked prefixes never fill the disk that holds them.
MIN_FREE_DISK_BYTES = 1 << 30
INDEX_NAME = "index.json"
#: A restore took when the reply's cached tokens reach this share of what it restored
#: (a reply shares all of the restored prefix but what the client rewrote, typically
#: the last assistant turn re-rendered: a few tokens out of thousands).
TOOK_SHARE = 0.5

_SUFFIX = ".slot"
#: The index's form: 2 knows each file's prompt (the files of 1 are removed when the lot
#: opens: no turn could be told to continue them).
_INDEX_VERSION = 2
_PARTIAL = "partial-"
#: What a slot file holds beside each token's KV: its token id, its cell's position and
#: sequence (measured: 16 bytes a token in SmolLM2's and the tiny model's files); and its
#: head (under 1 KiB there), at most.
_TOKEN_EXTRA_BYTES = 16
_FILE_HEAD_BYTES = 64 << 10


@dataclass(frozen=True)
class ParkKey:
    """Whose prefix a parked file holds: a model (`model_identity`), a key's flow, and
    one of its sessions.  Never stored as given: only as digests."""

    model: str
    flow: str
    session: str

    @property
    def file_name(self) -> str:
        return _digest(self.model, self.flow, self.session)[:40] + _SUFFIX

    @property
    def flow_digest(self) -> str:
        return _digest("flow", self.flow)

    @property
    def model_digest(self) -> str:
        return _digest("model", self.model)


@dataclass(frozen=True)
class Parked:
    """One parked file as the index knows it."""

    file: str
    model: str  #: digest of the model identity
    flow: str  #: digest of the key's flow
    tokens: int
    size: int
    sha256: str  #: the file as saved: anything else is never given to the engine
    used: float  #: wall-clock seconds of its last save or restore (LRU across restarts)
    #: The prompt it holds (`backend.admission.cache_misses.prompt_text`): its length in
    #: characters and `prompt_digest` of it; a turn is restored into only if it begins so.
    prompt_chars: int
    prompt_digest: str
    #: Context checkpoints the engine kept in it (-1: the engine does not say, so keeps none).
    checkpoints: int = -1

    def belongs_to(self, key: ParkKey) -> bool:
        return (self.file == key.file_name and self.flow == key.flow_digest
                and self.model == key.model_digest)

    def continued_by(self, prompt: str) -> bool:
        """Does a turn whose prompt text is `prompt` continue the prompt parked here?"""
        return (len(prompt) >= self.prompt_chars > 0
                and prompt_digest(prompt[:self.prompt_chars]) == self.prompt_digest)


@dataclass(frozen=True)
class Restored:
    """A restore the engine accepted: `tokens` are back in `slot`, with `checkpoints` of
    its context checkpoints (None: the engine does not say)."""

    slot: int
    tokens: int
    checkpoints: int | None = None

    def took(self, cache_n: int | None) -> bool:
        """Whether the reply that followed it reused the restored prefix."""
        return cache_n is not None and cache_n >= TOOK_SHARE * self.tokens


class ParkingLot:
    """The directory of parked slots, its index and its disk budget."""

    def __init__(self, directory: Path, *, budget: Callable[[], int] = lambda: DEFAULT_BUDGET_BYTES,
                 ttl: Callable[[], float] = lambda: DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.time,
                 free_disk: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free
                 ) -> None:
        """`budget()`: the bytes the files may take together; `ttl()`: the seconds one is
        kept unused; `free_disk(directory)`: the bytes free on its disk."""
        self.directory = Path(directory)
        self._budget = budget
        self._ttl = ttl
        self._clock = clock
        self._free_disk = free_disk
        self._index: dict[str, Parked] = {}
        self._opened = False

    def open(self) -> Path:
        """Make the directory (0700) and read the index, forgetting entries whose file
        is gone and removing files no entry names (a save cut short); the directory."""
        if not self._opened:
            self.directory.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
            make_private(self.directory / INDEX_NAME)
            self._index = _read_index(self.directory / INDEX_NAME)
            on_disk = {p.name for p in self.directory.iterdir() if p.name != INDEX_NAME}
            for name in on_disk - set(self._index):
                with contextlib.suppress(OSError):
                    (self.directory / name).unlink()
            gone = set(self._index) - on_disk
            for name in gone:
                del self._index[name]
            self._opened = True
            if gone:
                self._write_index()
            self.expire()
        return self.directory

    def find(self, key: ParkKey) -> Parked | None:
        """The file parked for `key`, only if the index says it is that key's (and it is
        not past its TTL: then it is removed)."""
        self.open()
        parked = self._index.get(key.file_name)
        if parked is not None and self._stale(parked):
            self._remove([parked], "unused for longer than the TTL")
            return None
        return parked if parked is not None and parked.belongs_to(key) else None

    def parked(self) -> list[Parked]:
        self.open()
        self.expire()
        return sorted(self._index.values(), key=lambda p: p.used)

    @property
    def budget_bytes(self) -> int:
        return self._budget()

    @property
    def ttl_seconds(self) -> float:
        return self._ttl()

    def expire(self) -> int:
        """Remove the files unused (neither saved nor restored) for longer than the TTL;
        how many."""
        self.open()
        stale = [p for p in self._index.values() if self._stale(p)]
        self._remove(stale, "unused for longer than the TTL")
        return len(stale)

    def keep_flows(self, flows: Iterable[str]) -> int:
        """Remove the files of every flow but `flows` (their keys were revoked or
        deleted); how many."""
        self.open()
        kept = {_digest("flow", flow) for flow in flows}
        gone = [p for p in self._index.values() if p.flow not in kept]
        self._remove(gone, "its key was revoked or deleted")
        return len(gone)

    @property
    def used_bytes(self) -> int:
        return sum(p.size for p in self._index.values())

    async def save(self, engine: SlotClient, slot: int, key: ParkKey, *, prompt: str,
                   token_bytes: int = 0, sequence_bytes: int = 0,
                   checkpoint_bytes: int = 0) -> Parked:
        """Save `slot` as `key`'s prefix (replacing what was parked for it), once its size
        is known to fit: within the budget (the least recently used files make room
        first) and leaving `MIN_FREE_DISK_BYTES` of the disk free.  `prompt`: the text
        of the prompt the slot holds (`Parked.continued_by`).  `token_bytes` and
        `sequence_bytes`: what a slot of this model holds a token and whatever its length
        (a sliding window, a recurrent state) as its header says, for a model with no
        file parked yet (its files say it better), and `checkpoint_bytes` the most its
        context checkpoints take (all it keeps).  SlotActionFailed when the
        slot is not saved (it does not fit, or the engine did not save it); nothing of
        it is left then, and nothing else was removed for it."""
        self.open()
        self.expire()
        if not prompt:
            raise SlotActionFailed(f"slot {slot}'s prompt is not known, so no turn could be "
                                   "told to continue it")
        tokens = await engine.slot_tokens(slot)
        if tokens <= 0:
            raise SlotActionFailed(f"slot {slot} holds no prompt to park")
        size = self._expected_size(key, tokens, token_bytes,
                                   sequence_bytes + max(0, checkpoint_bytes))
        budget = self._budget()
        if size > budget:
            raise SlotActionFailed(f"slot {slot}'s {tokens} tokens would take about "
                                   f"{_mib(size)} MiB, more than the {_mib(budget)} MiB "
                                   "parked prefixes may take together")
        replaced = self._index.get(key.file_name)
        free = await asyncio.to_thread(self._free_disk, self.directory)
        if free + (replaced.size if replaced is not None else 0) - size < MIN_FREE_DISK_BYTES:
            raise SlotActionFailed(f"slot {slot}'s {tokens} tokens would take about "
                                   f"{_mib(size)} MiB of the {_mib(free)} MiB free on the disk "
                                   f"of parked prefixes, leaving less than "
                                   f"{_mib(MIN_FREE_DISK_BYTES)} MiB")
        self._make_room(budget - size, key.file_name)
        # Written under a name of its own and renamed once private: a reader never meets
        # half a file or one readable by others under a parked name.
        partial = f"{_PARTIAL}{secrets.token_hex(8)}{_SUFFIX}"
        path = self.directory / partial
        try:
            saved = await engine.save(slot, partial)
            if saved.tokens <= 0:
                raise SlotActionFailed(f"slot {slot} holds no prompt to park")
            size, sha256 = await asyncio.to_thread(_seal, path, self.directory / key.file_name)
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        parked = Parked(key.file_name, key.model_digest, key.flow_digest, saved.tokens, size,
                        sha256, self._clock(), len(prompt), prompt_digest(prompt),
                        -1 if saved.checkpoints is None else saved.checkpoints)
        self._index[parked.file] = parked
        self._evict()  # an estimate that fell short
        self._write_index()
        return parked

    async def restore(self, engine: SlotClient, slot: int, key: ParkKey) -> Restored | None:
        """Load `key`'s parked prefix into `slot`.  None when nothing is parked for it, or
        the engine could not restore it (the file is dropped then, the slot is empty and
        the request is to be served with a plain prefill)."""
        parked = self.find(key)
        if parked is None:
            return None
        if not await asyncio.to_thread(_intact, self.directory / parked.file, parked):
            log.warning("a parked prefix of %d tokens changed on disk since it was saved; "
                        "it is dropped and the turn computes its prompt", parked.tokens)
            self.forget(key)
            return None
        try:
            tokens, checkpoints = await engine.restore(slot, parked.file)
        except SlotActionFailed as exc:
            log.warning("a parked prefix of %d tokens did not restore (%s); it is dropped "
                        "and the turn computes its prompt", parked.tokens, exc)
            self.forget(key)
            return None
        if tokens <= 0:
            self.forget(key)
            return None
        self._index[parked.file] = dataclasses.replace(parked, used=self._clock())
        self._write_index()
        return Restored(slot, tokens, checkpoints)

    def forget(self, key: ParkKey) -> None:
        """Drop what is parked for `key` (a restore that did not take, a session ended)."""
        self.open()
        if self._index.pop(key.file_name, None) is not None:
            with contextlib.suppress(OSError):
                (self.directory / key.file_name).unlink()
            self._write_index()

    def _stale(self, parked: Parked) -> bool:
        return self._clock() - parked.used >= self._ttl()

    def _remove(self, gone: Iterable[Parked], why: str) -> None:
        removed = 0
        for parked in gone:
            if self._index.pop(parked.file, None) is not None:
                removed += 1
                with contextlib.suppress(OSError):
                    (self.directory / parked.file).unlink()
        if removed:
            log.info("%d parked prefix(es) removed: %s", removed, why)
            self._write_index()

    def _expected_size(self, key: ParkKey, tokens: int, token_bytes: int,
                       sequence_bytes: int) -> int:
        """The bytes a file of `key`'s model holding `tokens` tokens takes: as its largest
        file parked says (its bytes a token), else from the header's figures.
        SlotActionFailed when neither tells."""
        known = [p for p in self._index.values() if p.model == key.model_digest and p.tokens > 0]
        if known:
            largest = max(known, key=lambda p: p.tokens)
            return -(-tokens * largest.size // largest.tokens)
        if token_bytes <= 0:
            raise SlotActionFailed("how large a slot of this model is cannot be told before "
                                   "saving it (its header does not say)")
        return tokens * (token_bytes + _TOKEN_EXTRA_BYTES) + sequence_bytes + _FILE_HEAD_BYTES

    def _make_room(self, room: int, replacing: str) -> None:
        """Evict the least recently used files until the others (not `replacing`, which
        the save replaces) take at most `room` bytes."""
        others = sorted((p for p in self._index.values() if p.file != replacing),
                        key=lambda p: p.used)
        used = sum(p.size for p in others)
        evicted = []
        for parked in others:
            if used <= room:
                break
            evicted.append(parked)
            used -= parked.size
        self._remove(evicted, "the least recently used, to make room within the budget")

    def _evict(self) -> None:
        budget = self._budget()
        by_age = sorted(self._index.values(), key=lambda p: p.used)
        used = sum(p.size for p in by_age)
        for parked in by_age:
            if used <= budget:
                break
            log.info("parked prefix of %d tokens evicted (%d bytes past the %d byte budget)",
                     parked.tokens, used - budget, budget)
            del self._index[parked.file]
            with contextlib.suppress(OSError):
                (self.directory / parked.file).unlink()
            used -= parked.size

    def _write_index(self) -> None:
        entries = [dataclasses.asdict(p) for p in self._index.values()]
        write_private(self.directory / INDEX_NAME,
                      json.dumps({"version": _INDEX_VERSION, "parked": entries}).encode())


def prompt_digest(prompt: str) -> str:
    """A digest of a prompt's text, the same in every process."""
    return hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def model_identity(model_path: str | os.PathLike[str], *extra: str) -> str:
    """A model as parked files know it: its file (path, size, modification time) and
    what else changes its cache (`extra`); a file edited or replaced is another model."""
    path = Path(model_path)
    try:
        info = path.stat()
        stamp = f"{info.st_size}:{info.st_mtime_ns}"
    except OSError:
        stamp = "missing"
    return _digest(str(path.resolve()), stamp, *extra)


# --- helpers ----------------------------------------------------------------------------


def _mib(n: int) -> int:
    return -(-n // (1 << 20))


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _seal(partial: Path, final: Path) -> tuple[int, str]:
    """The engine writes with the process umask; the file becomes 0600 before it takes
    its parked name.  Its size and SHA-256."""
    os.chmod(partial, PRIVATE_FILE_MODE)
    size, sha256 = _measure(partial)
    os.replace(partial, final)
    return size, sha256


def _intact(path: Path, parked: Parked) -> bool:
    try:
        return path.stat().st_size == parked.size and _measure(path) == (parked.size, parked.sha256)
    except OSError:
        return False


def _measure(path: Path) -> tuple[int, str]:
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256")
    return path.stat().st_size, digest.hexdigest()


def _read_index(path: Path) -> dict[str, Parked]:
    try:
        data = json.loads(path.read_bytes())
        entries = data["parked"] if isinstance(data, dict) else []
    except (OSError, ValueError, KeyError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _INDEX_VERSION:
        return {}
    found: dict[str, Parked] = {}
    fields = {f.name for f in dataclasses.fields(Parked)}
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and set(entry) == fields:
            try:
                parked = Parked(str(entry["file"]), str(entry["model"]), str(entry["flow"]),
                                int(entry["tokens"]), int(entry["size"]),
                                str(entry["sha256"]), float(entry["used"]),
                                int(entry["prompt_chars"]), str(entry["prompt_digest"]),
                                int(entry["checkpoints"]))
            except (TypeError, ValueError):
                continue
            if parked.file.endswith(_SUFFIX) and "/" not in parked.file:
                found[parked.file] = parked
    return found
