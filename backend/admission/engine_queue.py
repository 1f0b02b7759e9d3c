"""The slots and KV tokens of one engine: who runs on it now.

`AdmissionQueue` keeps the books of one engine (one `Serving`, keyed by its `key`: a new
process of a load has a new port, hence a new queue); its model's `Line`
(`backend.admission.line`) decides who goes next and on which engine.  A queue made
without a line stands in front of a line of its own.

Capacity is two numbers: free slots and free KV tokens.  A request's *need* is its
prompt tokens plus its output budget (`TokenNeed`, see `backend.admission.need_planner`).
An engine's cache (`KvCapacity`) is either

- **split**: each slot owns `total / slots` tokens, so a request must fit one slot
  (`need <= per_request`) and then always fits, whatever the others hold; or
- **unified**: one pool for every slot, so the needs of the running requests plus the
  newcomer's must fit `total` (and each need must fit `per_request`, the engine's cap
  on one sequence).

Each engine keeps seats, its slot ids 0..slots-1: an admission hands the ticket a
`Seat(engine, slot)`, a release gives the id back (O(1): the free ids are bits); growth
adds ids, a shrink stops reissuing the ids above it while the requests holding them
finish.  A slot id reaches the engine (`id_slot`) only when the placement pins the seat.

Like the line, this only decides: no sockets, no sleeps, no locks (one asyncio loop).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from types import EllipsisType

from backend.errors import ModelNotReady
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.admission.admission_ticket import Ticket
from backend.admission.line import Clock, Line
from backend.admission.seat import Seat

__all__ = ["OBSERVED_PREFILL_TOKENS", "AdmissionQueue"]

#: The fewest computed prompt tokens an answer's prefill time says the engine's pace by.
OBSERVED_PREFILL_TOKENS = 128


class AdmissionQueue:
    """The slots and KV tokens of one engine; its model's `Line` waits in front of it."""

    def __init__(self, serving: Serving, *, line: Line[AdmissionQueue] | None = None,
                 max_waiting: int = 0, enabled: bool = True, clock: Clock = time.monotonic,
                 label: str = "") -> None:
        self.serving = serving
        #: The engine's public name ("this machine", "upstream N"; never its address), as
        #: the metrics label what ran on it.
        self.label = label
        self._active = 0
        self._reserved = 0
        # Seats: slot ids 0..capacity-1 as bits, free ones set (O(1) take and give back;
        # the lowest free id is the lowest set bit); held ones, to rebuild the free set
        # when the capacity changes.
        self._free_ids = (1 << serving.slots) - 1
        self._held_ids = 0
        self._seats = _seats(self, serving.slots)
        # When each slot id was last given back (-1: never), as llama-server stamps its
        # slots: an unpinned request takes the one released longest ago.
        self._released: dict[int, int] = {}
        # Seconds a prompt token took, as its answers showed (`observe_prefill`).
        self._seconds_a_token: float | None = None
        self._enabled = enabled
        self._retired = False
        self.line: Line[AdmissionQueue] = (
            line if line is not None else Line(max_waiting=max_waiting, clock=clock))
        self.line.attach(self)

    # --- state -----------------------------------------------------------------------

    @property
    def key(self) -> str:
        return self.serving.key

    @property
    def api_key(self) -> str | None:
        """What the engine requires in its Authorization header, if anything."""
        return self.serving.api_key

    @property
    def capacity(self) -> int:
        return self.serving.slots

    @property
    def kv(self) -> KvCapacity | None:
        """None: the cache is unknown and only slots are counted."""
        return self.serving.kv

    @property
    def active(self) -> int:
        return self._active

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity - self._active)

    def lowest_free_slot(self) -> int | None:
        """The lowest free slot id; None when every id is held (or admission is off and
        more run than there are slots)."""
        free = self._free_ids
        return (free & -free).bit_length() - 1 if free else None

    def lowest_free_seat(self) -> Seat[AdmissionQueue]:
        free = self._free_ids
        return self._seats[(free & -free).bit_length() - 1] if free else self._seats[-1]

    def least_recent_free_seat(self) -> Seat[AdmissionQueue]:
        """The seat of the free slot given back longest ago (never used ones first, the
        highest id among equals, as llama-server picks an idle slot by LRU)."""
        free = self._free_ids
        if not free:
            return self._seats[-1]
        released = self._released
        best, stamp = -1, 0
        while free:
            slot = (free & -free).bit_length() - 1
            free &= free - 1
            when = released.get(slot, -1)
            if best < 0 or when <= stamp:
                best, stamp = slot, when
        return self._seats[best]

    def slot_free(self, slot: int) -> bool:
        return slot >= 0 and bool(self._free_ids >> slot & 1)

    def slot_used(self, slot: int) -> bool:
        """Has slot id `slot` held a request since the engine started?"""
        return slot in self._released

    def touch(self, slot: int) -> None:
        """Free slot `slot` served a request outside admission (the session steward's):
        the engine counts it as its most recently used, and so does
        `least_recent_free_seat`."""
        self._released[slot] = next(_releases)

    @property
    def pin_any_slot(self) -> bool:
        """See `Serving.pin_any_slot`."""
        return self.serving.pin_any_slot

    @property
    def finds_prefix_in_ram(self) -> bool:
        """See `Serving.finds_prefix_in_ram`."""
        return self.serving.finds_prefix_in_ram

    def free_slot_ids(self) -> list[int]:
        """The slot ids free now, the lowest first."""
        free = self._free_ids
        ids = []
        while free:
            ids.append((free & -free).bit_length() - 1)
            free &= free - 1
        return ids

    def prefill_seconds(self, tokens: int) -> float | None:
        """A fresh prompt of `tokens`, computed at the depths it reaches
        (`backend.llama.engine_speed.SpeedModel`); on an engine not measured so (an
        attached llama-server), at the pace its answers' prefills showed
        (`observe_prefill`); None: neither known."""
        speed = self.serving.speed
        if speed is not None:
            return speed.model.chunk_seconds(tokens, 0)
        return None if self._seconds_a_token is None else tokens * self._seconds_a_token

    def observe_prefill(self, computed: int, seconds: float) -> None:
        """An answer of this engine computed `computed` prompt tokens in `seconds` (its
        `timings`): the pace `prefill_seconds` reads where the engine was not measured
        after its load, a moving mean of prefills long enough to say it (short ones are
        mostly the request's own overhead)."""
        if computed < OBSERVED_PREFILL_TOKENS or seconds <= 0:
            return
        pace = seconds / computed
        known = self._seconds_a_token
        self._seconds_a_token = pace if known is None else known + (pace - known) * 0.3

    @property
    def counts_prompts(self) -> bool:
        """A llama-server counts prompts; another GGUF Studio port (it takes no slot ids
        either) has no counting routes."""
        return self.serving.takes_slot_ids

    @property
    def waiting(self) -> int:
        """Everyone in this engine's line, whether for a slot or for KV tokens."""
        return 0 if self._retired else self.line.waiting

    @property
    def reserved_tokens(self) -> int:
        """KV tokens held by the running requests on this engine."""
        return self._reserved

    @property
    def kv_capacity(self) -> int:
        """The engine's total KV tokens, 0 while unknown."""
        return 0 if self.kv is None else self.kv.total

    @property
    def idle(self) -> bool:
        """Nothing runs on it and nobody waits for it."""
        return self._active == 0 and self.waiting == 0

    @property
    def retired(self) -> bool:
        """No longer serving: admits no one new; what runs on it goes on."""
        return self._retired

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        self.line.admit_waiting()

    @property
    def max_waiting(self) -> int:
        return self.line.max_waiting

    @max_waiting.setter
    def max_waiting(self, value: int) -> None:
        self.line.max_waiting = value

    @property
    def service_time(self) -> float:
        """Recent mean admitted→released duration in seconds, on its line."""
        return self.line.service_time

    # --- decisions -------------------------------------------------------------------

    def request(self, need: TokenNeed | int | None = None, *, size: int = 0,
                max_waiting_bytes: int = 0) -> Ticket:
        """A ticket in this engine's line (see `Line.request`); ModelNotReady once the
        engine is retired."""
        if self._retired:
            raise ModelNotReady("The model is being reloaded. Try again shortly.",
                                retry_after=self.line.retry_after())
        return self.line.request(need, size=size, max_waiting_bytes=max_waiting_bytes)

    def fits_now(self, need: TokenNeed | int | None) -> bool:
        """Would `request(need)` admit at once?  See `Line.fits_now`."""
        return not self._retired and self.line.fits_now(need)

    def admit_waiting(self) -> None:
        """Admit from the head of the line while there is room (after a requeue or a
        slot released on hold)."""
        self.line.admit_waiting()

    def set_capacity(self, n: int, kv: KvCapacity | None | EllipsisType = ...) -> None:
        """Growth admits waiters in order; a shrink lets running requests finish.

        `kv` replaces the cache's size (omitted: unchanged).  Waiters whose need no
        longer fits any engine of the line are refused with ContextLengthExceeded.
        """
        _check_capacity(n)
        new_kv = self.kv if kv is ... else kv
        self.serving = _replace_serving(self.serving, slots=n, kv=new_kv)
        # Growth adds ids; a shrink stops reissuing the ids >= n (held ones finish).
        self._free_ids = ((1 << n) - 1) & ~self._held_ids
        self._seats = _seats(self, n)
        self.line.engines_changed()

    def retry_after(self, position: int | None = None) -> float:
        return self.line.retry_after(position)

    def has_room(self, need: TokenNeed | None) -> bool:
        """A free slot, and the need fits one request's share and the free tokens."""
        kv = self.kv
        if need is not None and kv is not None and need.total > kv.per_request:
            return False  # never here: another engine of the model may take it
        if not self._enabled:
            return True
        if self._active >= self.capacity:
            return False
        # A split cache gives every slot its own share, checked above; only a unified
        # pool can run out with a slot free.
        if need is None or kv is None or not kv.unified:
            return True
        return self._reserved + need.total <= kv.total

    def __repr__(self) -> str:
        flag = " retired" if self._retired else ""
        tokens = (f", {self._reserved}/{self.kv.total} tokens"
                  if self.kv is not None else "")
        return (f"<AdmissionQueue {self.key} {self._active}/{self.capacity} active"
                f"{tokens}, {self.waiting} waiting{flag}>")

    # --- the line's bookkeeping ---------------------------------------------------------

    def take(self, ticket: Ticket, now: float, seat: Seat[AdmissionQueue] | None = None) -> None:
        """Admit `ticket` on `seat` (its slot must be free; None: the lowest free one)."""
        if seat is None:
            seat = self.lowest_free_seat()
        slot = seat.slot
        if slot is not None:
            bit = 1 << slot
            assert self._free_ids & bit, f"slot {slot} of {self.key} is not free"
            self._free_ids ^= bit
            self._held_ids |= bit
        self._active += 1
        self._reserved += ticket.tokens
        ticket.admit(seat, now)

    def give_back(self, ticket: Ticket) -> None:
        self._active -= 1
        self._reserved -= ticket.tokens
        seat = ticket.seat
        slot = None if seat is None else seat.slot
        if slot is not None:
            bit = 1 << slot
            self._held_ids &= ~bit
            if slot < self.serving.slots:
                self._free_ids |= bit
            self._released[slot] = next(_releases)

    def give_back_tokens(self, tokens: int) -> None:
        self._reserved -= tokens

    def retire(self) -> None:
        self._retired = True
        self.line.detach(self)

    def serve(self, serving: Serving, line: Line[AdmissionQueue]) -> None:
        """Serve again (the same engine re-read, or back after retiring) on `line`."""
        self.serving = serving
        self._free_ids = ((1 << serving.slots) - 1) & ~self._held_ids
        self._seats = _seats(self, serving.slots)
        self._retired = False
        if self.line is not line:
            self.line.detach(self)
            self.line = line
        line.attach(self)



_releases = itertools.count()


def _seats(engine: AdmissionQueue, n: int) -> list[Seat[AdmissionQueue]]:
    """Each slot id's unpinned seat, and last the seat beyond the slots (admission off)."""
    return [Seat(engine, slot) for slot in range(n)] + [Seat(engine, None)]


def _check_capacity(n: int) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"capacity must be a whole number of slots, at least 1, not {n!r}")
    return n


def _replace_serving(serving: Serving, *, slots: int, kv: KvCapacity | None) -> Serving:
    return dataclasses.replace(serving, slots=slots, kv=kv)

