"""The steward of parked prefixes: what live sessions hold is saved before an engine goes
away on purpose, and put back before their next turn.

Planned losses all pass through `Pool.unload_model` (an idle TTL, an eviction for
another model, an unload, a swap of the default model, the app closing): there, once the
engine's requests drained and before it stops, `park` saves the slots of the sessions
resident on it (`Residents`), each as its key's own file (`backend.llama.slot_parking`).
A save that hangs does not hold the unload: all saves of one engine share
`PARK_TIME_LIMIT` seconds, then the engine stops whatever is left unsaved.

A session's next turn, once admission gave it a seat (a slot of an engine), is looked up
by the relay (`before_send`): when its prefix is parked for its key on this model, it is
restored into the seat's slot and the seat is pinned (`id_slot`), so the engine reuses it.
A restore overwrites its slot: when that holds another session's prefix (agents back
together after a break), the prefix is first moved to the engine's RAM prompt cache
(`SlotClient.vacate`), where that session's next turn finds it.
The reply's cached tokens say whether it took (`after_answer`); one that did not is
dropped, and the turn was a plain prefill anyway.  Admission itself does no I/O: this
runs between the seat and the request.

A prefix is restored only into a turn that continues the prompt parked with it (the
text of the session's last request, `backend.admission.prompt.Prompt.text`, whose digest
the lot keeps): a session's name that comes again with another conversation (an agent
run again under the same ids, a title request) gets no stale prefix.  A model whose
memory cannot be rolled back (sliding-window layers without `--swa-full`, recurrent
layers) takes a restored prefix back to where the next turn parts from it only through
the slot's context checkpoints, which an engine keeps in its save files with our patch
(`Serving.parks_checkpoints`); on an engine that does not, such a model's sessions are
not parked at all (`ability` says so, for the Model tab and /health).

Which slot holds which session is the session book's (`backend.admission.session_book`):
placement pins the turns that keep prefixes, and each request's settlement tells the book
where its turn's prefix went.  A session whose slot another session took lives on in the
engine's RAM prompt cache, which llama-server cannot save and which goes with the
process.  For those, the steward has the book keep each session's last request
(`remember`, bounded by `session_book.REMEMBERED_BYTES`) and, once the slots are saved,
sends it again pinned to a saved slot for one token (`SlotClient.recall`): a pinned request on an engine that keeps
prefixes loads its prompt from that cache (`backend.llama.supervisor.PREFIX_CACHE_ARGS`),
and the slot is then saved as that session's.  Only where the port pins slots: elsewhere
no slot is known to hold a prompt, and pinning an empty one skips the RAM cache.

A turn the engine cannot pin (Claude Code's `/v1/messages`: llama-server's Anthropic
conversion drops `id_slot`) goes to the engine's least recently used idle slot, which
placement gives it as its seat, and looks for its prefix in the RAM cache only.  When its
session's prefix is in another idle slot, the steward moves it there first (`_gather`,
one pinned one-token request); before, every such turn computed the turns since its
slot was last the least recently used (measured: twice its new tokens, and the second
turn its whole prompt).  Its parked prefix is restored into its seat like any other;
when the seat holds another session's prefix, that one is moved to the RAM cache first
and every other idle slot made more recent (`_least_recent`), so that the seat is still
the one the engine picks.  Such a session held only in the RAM cache is recalled before a
planned loss too: its request goes to the least recently used slot, so the steward first
makes every other slot more recent (their prefixes are saved by then).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from backend.admission.admission_ticket import Ticket
from backend.admission.prompt import prompt_text
from backend.api_paths import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from backend.admission.session_book import Session, SessionRequest, Sessions
from backend.app.pool.pool_config import ModelEntry
from backend.errors import StudioError
from backend.models.fit import KvShape, format_bytes, load_memory
from backend.models.gguf_info import read_model_info
from backend.port import sse
from backend.llama.load import Serving
from backend.llama.slot_actions import SlotActionFailed, SlotClient
from backend.llama.slot_parking import ParkingLot, ParkKey, Restored, model_identity

__all__ = ["PARK_TIME_LIMIT", "ParkingAbility", "ParkingSteward"]

log = logging.getLogger("gguf_studio.parking")

#: Seconds all saves before one engine's planned loss may take together.  A save writes
#: the slot's KV (SmolLM2: 22 KiB a token; a 7B model: 128 KiB, 4 GB for a 30k-token
#: agent prompt, seconds on an SSD); past this the engine stops with what is left unsaved.
PARK_TIME_LIMIT = 15.0
#: Seconds moving a session's prefix to the RAM prompt cache (`SlotClient.vacate`, before
#: a turn the engine cannot pin or one seated on a slot that holds another prompt) may
#: take at least.  The copy itself is quick (about a second for a 7B model's 30k-token
#: prompt, 4 GB, by estimate), but the engine takes the vacating request only between
#: the batches of the prompts it computes: on a loaded 2-core machine (load 9-12) a batch
#: of another slot's 350 new tokens took 12.7 s and a first prompt of 1,594 tokens, one
#: batch, 87 s; 5 s cut 9 vacates of one run short, each turn then reusing another
#: session's prompt in place and computing its own past the shared head (bench/README.md,
#: the attached pool).  Given up only when something else holds the slot (a client of
#: the engine's own) or the engine hangs: `VACATE_BATCH_TOKENS` at the engine's measured
#: speed, twice, when that is longer.
GATHER_TIME_LIMIT = 120.0
#: Prompt tokens of one batch the engine may be computing when a vacate arrives
#: (llama-server's default `--batch-size`).
VACATE_BATCH_TOKENS = 2048
#: The routes whose requests are sent again that way.  They read `n_predict` and
#: `id_slot` (a Responses request becomes a chat one with its other fields kept), except
#: an Anthropic one, which keeps only its own: it goes to the engine's least recently used
#: slot, so every other slot is made more recent first (`park`).
_RECALLED_ROUTES = frozenset((CHAT, COMPLETIONS, RESPONSES, MESSAGES))


@dataclass(frozen=True)
class ParkingAbility:
    """What parking does for a model on its engine, for the Model tab and /health."""

    #: Its sessions' prefixes are parked before a planned loss and restored after.
    parks: bool
    #: What of its memory cannot be rolled back ("a sliding window", "a recurrent state",
    #: both, or "" when every layer keeps every token): a parked prefix of it is of use
    #: only with the slot's context checkpoints.
    rollback: str
    #: Context checkpoints a slot keeps, each parked with it (0: none needed or kept).
    checkpoints: int
    #: For people: what it does, or why not.
    says: str

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Pending:
    """A restore whose reply has yet to say whether it took."""

    key: ParkKey
    restored: Restored


@dataclass(frozen=True)
class _Memory:
    """What a model's header says of a parked slot of it, at its load settings."""

    token_bytes: int  #: a token of its prompt (f16)
    sequence_bytes: int  #: whatever its length: a sliding window, a recurrent state
    rollback: str  #: see `ParkingAbility.rollback`
    checkpoints: int  #: the context checkpoints a slot keeps (-ctxcp, the app's default)
    #: One of them: the cells a slot's sliding layers still use (its window) and its
    #: recurrent state (`backend.models.fit.context_memory`).
    checkpoint_bytes: int = 0


class ParkingSteward:
    """Parks the slots of live sessions before planned losses and restores them."""

    def __init__(self, lot: ParkingLot, *, entry_of: Callable[[str], ModelEntry | None],
                 sessions: Sessions, time_limit: float = PARK_TIME_LIMIT) -> None:
        self.lot = lot
        self._entry_of = entry_of
        #: The session book: where sessions live, and their last requests.
        self.sessions = sessions
        # (model, engine key) -> its identity: worked out once per engine process (it
        # reads the model file's size and time), not per request.
        self._identities: dict[tuple[str, str], str | None] = {}
        # Model -> what its header says of a slot of it (read once: it reads the file).
        self._memories: dict[str, _Memory] = {}
        self.time_limit = time_limit
        #: Figures for the log and the window: saves, those among them brought back
        #: from the RAM prompt cache (as far as the answers' timings say: a Responses
        #: answer has none), restores that took, that did not, parks that failed,
        #: prefixes moved to the RAM cache for turns that cannot be pinned (`_gather`),
        #: parked prefixes left unrestored because the turn began another conversation,
        #: sessions not parked because nothing could restore them (their model's
        #: engine keeps no checkpoints in its files, or their prompt was not kept), and
        #: slots of attached engines vacated for returning sessions (`_vacate_seat`).
        self.counts = {"parked": 0, "recalled": 0, "restored": 0, "not_taken": 0,
                       "park_failed": 0, "gathered": 0, "not_continued": 0, "not_parked": 0,
                       "vacated": 0}

    # --- before a planned loss ----------------------------------------------------------

    async def park(self, model: str, serving: Serving) -> int:
        """Save the slots of the sessions resident on `model`'s engine `serving` (drained:
        nothing runs on it), within `time_limit` seconds; how many were saved."""
        identity = self.identity(model, serving.key)
        self._identities.pop((model, serving.key), None)
        if identity is None or self.lot.budget_bytes <= 0 or self.lot.ttl_seconds <= 0:
            return 0
        residents = self.sessions.resident(serving.key)
        memory = await self._memory(model)
        ability = self._ability(memory, serving)
        if not ability.parks:
            if residents:
                self.counts["not_parked"] += len(residents)
                log.info("%s: %d session prefixes not parked: %s", model, len(residents),
                         ability.says)
            return 0
        in_slots: list[tuple[int, ParkKey, SessionRequest]] = []
        in_ram: list[tuple[ParkKey, SessionRequest]] = []
        unknown = 0
        for resident in residents:
            key = ParkKey(identity, resident.flow, resident.key)
            last = self.sessions.last_request(key)
            if last is None:
                unknown += 1  # no turn could be told to continue it
            elif resident.slot is not None:
                in_slots.append((resident.slot, key, last))
            else:
                in_ram.append((key, last))
        if unknown:
            self.counts["not_parked"] += unknown
            log.info("%s: %d session prefixes not parked: their last requests were not kept",
                     model, unknown)
        # Brought back into the most recent session's slot once that is saved (a slot
        # that holds a prompt, so the pinned request consults the RAM cache).
        spare = in_slots[-1][0] if in_slots and serving.pin_any_slot else None
        parked: list[tuple[int, ParkKey, SessionRequest, bool]] = [
            (slot, key, last, False) for slot, key, last in reversed(in_slots)]  # most recent first
        if spare is not None:
            parked += [(spare, key, last, True) for key, last in reversed(in_ram)]
        if not parked:
            return 0
        saved = tried = recalled = 0
        started = time.monotonic()
        async with SlotClient(serving.base_url, api_key=serving.api_key,
                              timeout=self.time_limit) as engine:
            try:
                async with asyncio.timeout(self.time_limit):
                    for slot, key, request, recall in parked:
                        tried += 1
                        try:
                            if recall:
                                if request.path == MESSAGES:
                                    # Their prefixes are parked: `slot` becomes the one
                                    # the engine used least recently.
                                    for other in range(serving.slots):
                                        if other != slot:
                                            await engine.vacate(other)
                                cached, computed = await engine.recall(
                                    slot, request.path, request.body)
                                recalled += cached > computed
                            await self.lot.save(engine, slot, key, prompt=_text(request.body),
                                                token_bytes=memory.token_bytes,
                                                sequence_bytes=memory.sequence_bytes,
                                                checkpoint_bytes=ability.checkpoints
                                                * memory.checkpoint_bytes)
                            saved += 1
                        except (SlotActionFailed, OSError, StudioError) as exc:
                            self.counts["park_failed"] += 1
                            log.warning("%s: a session's prefix was not parked (%s)", model, exc)
            except TimeoutError:
                self.counts["park_failed"] += len(parked) - tried + 1
                log.warning("%s: parking gave up after %g s with %d of %d sessions saved",
                            model, self.time_limit, saved, len(parked))
        self.counts["parked"] += saved
        self.counts["recalled"] += recalled
        log.info("%s: parked %d session prefixes (%d of them brought back from the RAM "
                 "prompt cache) in %.2f s", model, saved, recalled, time.monotonic() - started)
        return saved

    def keep_flows(self, flows: Collection[str]) -> None:
        """Forget the parked prefixes of every flow but `flows` (their keys were revoked
        or deleted): prompts are not kept past their key (the session book forgets the
        rest of those sessions: `Sessions.keep_flows`)."""
        try:
            self.lot.keep_flows(flows)
        except (OSError, StudioError) as exc:
            log.warning("parked prefixes of revoked keys were not removed (%s)", exc)

    def expire(self) -> None:
        """Remove the parked prefixes unused for longer than the lot's TTL."""
        try:
            self.lot.expire()
        except (OSError, StudioError) as exc:
            log.warning("parked prefixes past their TTL were not removed (%s)", exc)

    def remember(self, ticket: Ticket, model: str | None, path: str, body: bytes) -> None:
        """Keep an answered request of a session (`body` as the engine took it), the
        latest of its conversation (not a side turn's): what brings its prefix back from
        the engine's RAM cache when `park` comes (see the module's doc).  O(1) but for
        what it drops."""
        session = ticket.hint.session
        if session is None or model is None or path not in _RECALLED_ROUTES:
            return
        identity = self.identity(model, ticket.serving.key)
        if identity is None:
            return
        self.sessions.remember(ParkKey(identity, ticket.flow.key, session),
                               SessionRequest(path, body, ticket.hint.prefix[:1]))

    # --- a session's next turn -----------------------------------------------------------

    async def before_send(self, ticket: Ticket, model: str | None,
                          body: bytes = b"") -> object | None:
        """Between the seat and the request (`body`, as the engine takes it): restore the
        session's parked prefix into the seat's slot, when the request continues it, and
        pin the seat to it.  What `after_answer` needs (None: nothing).  Parking never
        fails a request: whatever goes wrong, the turn is a plain prefill."""
        seat = ticket.seat
        if seat is not None and seat.vacate and seat.slot is not None:
            await self._vacate_seat(ticket, seat.slot)
        try:
            return await self._restore(ticket, model, body)
        except (OSError, StudioError) as exc:
            log.warning("a parked prefix was not restored (%s); the turn computes its prompt",
                        exc)
            return None

    def after_answer(self, pending: object | None, tail: bytes) -> None:
        """The reply to a restored turn: keep the parked file when the restore took (its
        cached tokens reached the restored prefix), drop it when it did not."""
        if not isinstance(pending, _Pending):
            return
        figures = sse.find_prompt_cache(tail)
        cache_n = None if figures is None else figures[0]
        if pending.restored.took(cache_n):
            self.counts["restored"] += 1
            return
        self.counts["not_taken"] += 1
        log.warning("a restored prefix of %d tokens did not take (the reply reused %s); it "
                    "is dropped", pending.restored.tokens, cache_n)
        try:
            self.lot.forget(pending.key)
        except (OSError, StudioError) as exc:
            log.warning("a parked prefix could not be dropped (%s)", exc)

    def slot_dir(self) -> Path | None:
        """The directory engines save slots to, made private; None (the engine starts
        without one, nothing is parked) when it cannot be made."""
        try:
            return self.lot.open()
        except (OSError, StudioError) as exc:
            log.warning("parked prefixes are off: %s (%s)", self.lot.directory, exc)
            return None

    def ability(self, model: str, serving: Serving | None) -> ParkingAbility:
        """What parking does for `model` on its engine `serving` (None: not loaded).  Reads
        the model's header the first time (once parked or restored, it is known)."""
        identity = self.identity(model, serving.key if serving is not None else "")
        if identity is None:
            entry = self._entry_of(model)
            why = ("an engine elsewhere (its slots are not this port's to save)"
                   if entry is None else "an isolated model (no request reuses another's prompt)")
            return ParkingAbility(False, "", 0, f"Parking: off for {why}.")
        return self._ability(self._memory_now(model), serving)

    def identity(self, model: str, engine: str) -> str | None:
        """A local model as its parked files know it: its file, and the settings that
        shape its cache.  None for an engine elsewhere (its slots are not ours to park)
        and for an isolated model (no request of it reuses any other's prompt)."""
        known = (model, engine)
        if known not in self._identities:
            entry = self._entry_of(model)
            self._identities[known] = None if entry is None or entry.isolated else \
                model_identity(Path(entry.path), str(entry.settings.ctx_size),
                               *entry.settings.extra_args)
        return self._identities[known]


    async def _restore(self, ticket: Ticket, model: str | None, body: bytes) -> object | None:
        session = ticket.hint.session
        seat = ticket.seat
        if session is None or seat is None or seat.slot is None or model is None:
            return None
        identity = self.identity(model, ticket.serving.key)
        if identity is None:
            return None
        key = ParkKey(identity, ticket.flow.key, session)
        restored = None
        # Parked, and not on this engine since: a turn after a restore finds its prefix
        # in its slot (or the engine's RAM cache), newer than the file.
        where = self.sessions.where(session)
        here = where is not None and where.engine == ticket.serving.key
        pinnable = ticket.hint.pinnable
        if where is not None and here and not pinnable:
            await self._gather(ticket, where)
            return None
        parked = None if here else self.lot.find(key)
        if parked is not None and not parked.continued_by(await asyncio.to_thread(_text, body)):
            # Another conversation under the session's name: its prefix stays parked for
            # the conversation it belongs to (replaced when this one is parked).
            self.counts["not_continued"] += 1
            log.info("a parked prefix of %d tokens was not restored: the turn does not "
                     "continue its prompt", parked.tokens)
            return None
        if parked is not None and not self._ability(await self._memory(model),
                                                    ticket.serving).parks:
            return None  # parked before, for an engine that could restore it
        if parked is not None:
            serving = ticket.serving
            holder = self.sessions.holder(serving.key, seat.slot)
            taken = holder is not None and holder.key != session
            if taken and not pinnable and not serving.pin_any_slot:
                return None  # its prefix could not be kept: a plain prefill is no worse
            async with SlotClient(serving.base_url, api_key=serving.api_key) as engine:
                if taken:
                    # Agents back together after a break: the slot holds a prefix
                    # restored a turn ago, which is nowhere else on this engine.
                    try:
                        await engine.vacate(seat.slot)
                        if not pinnable:
                            await self._least_recent(engine, ticket)
                    except SlotActionFailed as exc:
                        log.warning("a slot's prefix was not kept before a restore into "
                                    "it (%s); its session computes it again", exc)
                restored = await self.lot.restore(engine, seat.slot, key)
            if restored is None:
                self.counts["not_taken"] += 1
        if restored is not None and not seat.pinned and pinnable:
            ticket.seat = dataclasses.replace(seat, pinned=True)
        return _Pending(key, restored) if restored is not None else None

    async def _least_recent(self, engine: SlotClient, ticket: Ticket) -> None:
        """A turn the engine cannot pin goes to its least recently used idle slot, its
        seat: once the seat was vacated (the most recent now), every other idle slot is
        vacated too (their prefixes to the RAM cache, where their sessions' pinned turns
        find them), so that the seat is the least recent again when the turn comes."""
        seat = ticket.seat
        assert seat is not None and seat.slot is not None
        seat.engine.touch(seat.slot)
        for other in range(ticket.serving.slots):
            if other != seat.slot and seat.engine.slot_free(other):
                await engine.vacate(other)
                seat.engine.touch(other)

    async def _memory(self, model: str) -> _Memory:
        if model not in self._memories:
            self._memories[model] = await asyncio.to_thread(_header_memory,
                                                            self._entry_of(model))
        return self._memories[model]

    def _memory_now(self, model: str) -> _Memory:
        if model not in self._memories:
            self._memories[model] = _header_memory(self._entry_of(model))
        return self._memories[model]

    def _ability(self, memory: _Memory, serving: Serving | None) -> ParkingAbility:
        if self.lot.budget_bytes <= 0 or self.lot.ttl_seconds <= 0:
            return ParkingAbility(False, memory.rollback, 0, "Parking: off (no days or no disk "
                                  "to keep parked prompts: parked_slots_days, parked_slots_mib).")
        done = ("Parking: a session's prompt is saved before its model unloads (idle TTL, "
                "eviction, Unload, a restart) and restored for its next turn, which then "
                "computes only what is new")
        if not memory.rollback:
            return ParkingAbility(True, "", 0, done + ".")
        why = (f"its layers keep {memory.rollback}, which the engine takes back to where a "
               "turn parts from the parked one only through the slot's context checkpoints")
        if memory.checkpoints <= 0:
            return ParkingAbility(False, memory.rollback, 0, f"Parking: off: {why}, and its "
                                  "engine keeps none (--ctx-checkpoints 0).")
        if serving is None or serving.parks_checkpoints is None:
            return ParkingAbility(False, memory.rollback, memory.checkpoints,
                                  f"Parking: once loaded, if its engine keeps the context "
                                  f"checkpoints in its saved slots: {why}.")
        if not serving.parks_checkpoints:
            return ParkingAbility(False, memory.rollback, memory.checkpoints, (
                f"Parking: off: {why}, and this llama-server does not save them with a slot "
                "(GGUF Studio's own engine does: gguf-studio engine build); its sessions "
                "compute their prompts again after an unload or restart."))
        return ParkingAbility(True, memory.rollback, memory.checkpoints, (
            f"{done}: {why}, and its engine saves them with the slot (up to "
            f"{memory.checkpoints} a slot, about {format_bytes(memory.checkpoint_bytes)} each)."))

    async def _vacate_seat(self, ticket: Ticket, slot: int) -> None:
        """A turn seated on a slot that holds another prompt, on an attached llama-server
        (`Seat.vacate`): that prompt goes to the engine's RAM prompt cache first, so the
        pinned turn loads its own prefix from there instead of reusing the other's in
        place from the shared head on.  A turn the engine cannot pin (it takes the idle
        slot most similar to its prompt, else the least recently used one): every other
        idle slot is vacated too, so that none is similar and the seat is the least
        recently used (`_least_recent`)."""
        serving = ticket.serving
        try:
            async with SlotClient(serving.base_url, api_key=serving.api_key,
                                  timeout=_vacate_limit(ticket)) as engine:
                await engine.vacate(slot)
                if not ticket.hint.pinnable:
                    await self._least_recent(engine, ticket)
            self.counts["vacated"] += 1
        except SlotActionFailed as exc:
            log.warning("a slot was not vacated for a returning session (%s); its turn "
                        "may compute its prompt again", exc)

    async def _gather(self, ticket: Ticket, where: Session) -> None:
        """A turn the engine cannot pin (`Hint.pinnable`) goes to the engine's least
        recently used slot, its seat, and looks for its prefix in the RAM prompt cache
        only (an engine that keeps prefixes never picks a slot by its prompt).  When its
        session's prefix is in another slot, idle, it is moved to that cache first; the
        slot then counts as just used, there and in the port's books."""
        seat = ticket.seat
        slot = where.slot
        serving = ticket.serving
        if seat is None or slot is None or slot == seat.slot or not serving.pin_any_slot:
            return  # in its seat already, or in the RAM cache
        holder = self.sessions.holder(serving.key, slot)
        if holder is None or holder.key != where.key or not seat.engine.slot_free(slot):
            return  # its slot was taken since: the engine moved it to the RAM cache then
        seat.engine.touch(slot)
        try:
            async with SlotClient(serving.base_url, api_key=serving.api_key,
                                  timeout=_vacate_limit(ticket)) as engine:
                await engine.vacate(slot)
            self.counts["gathered"] += 1
        except SlotActionFailed as exc:
            # A request admitted onto that slot meanwhile moved the prefix there itself.
            log.warning("a prefix was not moved to the RAM prompt cache for a turn that "
                        "cannot be pinned (%s)", exc)


# --- helpers -------------------------------------------------------------------------------


def _vacate_limit(ticket: Ticket) -> float:
    """Seconds a vacate before `ticket`'s turn may wait for its engine (`GATHER_TIME_LIMIT`)."""
    seat = ticket.seat
    batch = None if seat is None else seat.engine.prefill_seconds(VACATE_BATCH_TOKENS)
    return GATHER_TIME_LIMIT if batch is None else max(GATHER_TIME_LIMIT, 2 * batch)


def _header_memory(entry: ModelEntry | None) -> _Memory:
    """What a slot of `entry`'s model holds, as its header says (f16: the engine's default
    cache type; a quantized cache takes less): bytes a token of its prompt, and bytes
    whatever its length (a sliding window, a recurrent state); what of it cannot be rolled
    back, and the context checkpoints its slots keep (by its load settings); nothing
    known when the header does not say."""
    unknown = _Memory(0, 0, "", 0)
    if entry is None:
        return unknown
    try:
        info = read_model_info(entry.path)
    except (OSError, StudioError):
        return unknown
    shape = KvShape.from_model_info(info)
    memory = load_memory(info, entry.settings)
    if shape is None or memory is None:
        return unknown
    layout = memory.layout
    kept = [what for what, present in (
        ("a sliding window", layout.sliding_layers > 0 and not memory.settings.swa_full),
        ("a recurrent state", layout.recurrent_layers > 0)) if present]
    checkpoints = memory.settings.checkpoints if kept else 0
    each = memory.checkpoint_bytes // (checkpoints * max(1, memory.settings.slots)) \
        if checkpoints > 0 else 0
    return _Memory(shape.bytes_per_token, shape.bytes_per_sequence, " and ".join(kept),
                   checkpoints, each)


def _text(body: bytes) -> str:
    """A request body's prompt text (`Prompt.text`), "" when it is not a JSON object."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    return prompt_text(data) if isinstance(data, dict) else ""
