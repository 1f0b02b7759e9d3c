"""How many long cold prompts an engine computes at once, beside the streams it runs.

llama-server computes new prompts in the same steps as it decodes the running streams
(`backend.llama.engine_speed`): while a long prompt is computed every stream beside it
waits one chunk per step.  The stall budget bounds one step; this budget bounds how many
such prompts share the steps: two long prompts at once make every step carry twice the
prompt tokens (llama-server fills the batch from every slot that has prompt left) and
double the time the streams crawl.

A prompt is *long* when the tokens the engine must still compute for it (its prompt
tokens less what the engine's cache holds of it: `uncached`) reach `long_tokens`.  The
decision for one ticket and one engine (`PrefillBudget.admits`):

- a short prompt, or one mostly cached, always passes;
- a long one of the interactive or normal band waits while another long prompt is
  computed on that engine beside streams of those bands; it passes when none is (so at
  most one long cold prefill runs per engine while interactive streams decode), or when
  no such stream runs there (nobody would feel it);
- a long one of the batch band also waits while such streams run there at all, until
  it has waited the fair queue's aging (`aging` seconds): then it is treated as the band
  above, so it is never starved.

In a pool, `PrefillPlacement` places a long cold prompt on the engine, among those the
budget lets it start on, with the fewest running streams; anything else goes to the
line's own policy unchanged; a prompt that is long only where it is cold (its session's
prefix lives on one of the engines, which the budget lets it start on) goes to the
line's policy among every engine the budget admits it on, so that a warm turn is not sent
away from its prefix for having fewer streams elsewhere.  What an engine holds of a prompt
is the line's policy's knowledge (`CacheKnowledge`, `Placement.cached_tokens`: for
`KeepPrefixes` a session's turn whose prefix is resident counts only what it adds to its
last prompt; by default nothing counts as cached).

Pure: no I/O, no clock of its own (`now` is passed in), O(1) per decision for one engine.
The line tells the budget when a ticket starts (`started`), when the engine sent its first
bytes (`prefilled`: the prompt is computed) and when it ends (`ended`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from backend.admission.admission_ticket import WaitReason
from backend.admission.flow import Band, Flow
from backend.admission.hint import Hint
from backend.admission.placement import Placeable, Placement
from backend.admission.seat import Seat, SeatEngine

__all__ = ["LONG_PREFILL_TOKENS", "PREFILL_BUDGET", "CacheKnowledge", "NothingCached",
           "PrefillBudget", "PrefillPlaceable", "PrefillPlacement"]

#: Uncached prompt tokens from which a prompt counts as long: several steps' worth at a
#: CPU's budgeted batch, where its chunks stall the streams beside it for seconds.
LONG_PREFILL_TOKENS = 1024
#: The wait reason of a ticket this budget holds (keep-alives, /metrics, the inspector).
PREFILL_BUDGET = WaitReason.PREFILL_BUDGET


class CacheKnowledge(Protocol):
    """What an engine's cache already holds of a prompt (the session steward's answer)."""

    def cached_tokens(self, hint: Hint, engine: object) -> int:
        """Prompt tokens of the request with `hint` that `engine` will not compute."""


class NothingCached:
    """Until the session book answers: every prompt is computed in full."""

    def cached_tokens(self, hint: Hint, engine: object) -> int:
        return 0


class PrefillPlaceable(Placeable, Protocol):
    """What the budget reads of a ticket beside its need and hint: its own band (None:
    its flow's), its flow, and when it arrived."""

    @property
    def band(self) -> Band | None: ...

    @property
    def flow(self) -> Flow: ...

    @property
    def enqueued_at(self) -> float: ...


E = TypeVar("E", bound=SeatEngine)


class _EngineLoad:
    """The tickets running on one engine, as the budget counts them."""

    __slots__ = ("decoding", "prefilling")

    def __init__(self) -> None:
        #: Interactive and normal tickets past their prompt (or with a short one).
        self.decoding = 0
        #: Long cold prompts being computed, each with whether it decodes as a stream after.
        self.prefilling: dict[object, bool] = {}


class PrefillBudget:
    """The long cold prompts each engine of one line computes, and who may start one."""

    def __init__(self, *, long_tokens: int = LONG_PREFILL_TOKENS, aging: float = 30.0,
                 cache: CacheKnowledge | None = None) -> None:
        self.long_tokens = long_tokens
        self.aging = aging
        self.cache: CacheKnowledge = cache if cache is not None else NothingCached()
        #: The cache's knowledge was given (it then stays whatever the placement is).
        self.cache_given = cache is not None
        self._engines: dict[object, _EngineLoad] = {}
        self._running: dict[object, tuple[object, bool]] = {}  # ticket: engine, a stream?

    # --- decisions -------------------------------------------------------------------

    def uncached(self, ticket: Placeable, engine: object) -> int:
        """The prompt tokens `engine` must still compute for `ticket`."""
        need = ticket.need
        if need is None:
            return 0
        return max(0, need.prompt - self.cache.cached_tokens(ticket.hint, engine))

    def is_long(self, ticket: Placeable, engine: object) -> bool:
        return self.uncached(ticket, engine) >= self.long_tokens

    def admits(self, ticket: Placeable, engine: object, *, band: Band, waited: float) -> bool:
        """May `ticket` (of `band`, waiting for `waited` seconds) start on `engine` now,
        as far as prefills go?"""
        if not self.is_long(ticket, engine):
            return True
        load = self._engines.get(engine)
        if load is None or load.decoding == 0:
            return True  # no stream would feel it
        if band is Band.BATCH and waited < self.aging:
            return False
        return not load.prefilling

    def streams(self, engine: object) -> int:
        """Interactive and normal tickets running on `engine`, decoding or computing
        their prompt."""
        load = self._engines.get(engine)
        return 0 if load is None else load.decoding + sum(load.prefilling.values())

    def prefilling(self, engine: object) -> int:
        """Long cold prompts being computed on `engine`."""
        load = self._engines.get(engine)
        return 0 if load is None else len(load.prefilling)

    # --- what the line tells it ------------------------------------------------------------

    def started(self, ticket: PrefillPlaceable, engine: object) -> None:
        """`ticket` was admitted on `engine`."""
        own, band = ticket.band, ticket.flow.band
        stream = (own if own is not None and own > band else band) is not Band.BATCH
        need = ticket.need
        long = need is not None and need.prompt >= self.long_tokens and self.is_long(ticket, engine)
        if not (stream or long):
            return  # short batch work: nothing to count
        load = self._engines.get(engine)
        if load is None:
            load = self._engines[engine] = _EngineLoad()
        if long:
            load.prefilling[ticket] = stream
        else:
            load.decoding += 1
        self._running[ticket] = (engine, stream)

    def prefilled(self, ticket: object) -> bool:
        """The engine sent `ticket`'s first bytes: its prompt is computed.  True when it
        was a long one (another may start now)."""
        engine, _ = self._running.get(ticket, (None, False))
        load = self._engines.get(engine) if engine is not None else None
        if load is None or ticket not in load.prefilling:
            return False
        if load.prefilling.pop(ticket):
            load.decoding += 1
        return True

    def ended(self, ticket: object) -> None:
        """`ticket` left its engine (finished, abandoned or sent back in line)."""
        engine, stream = self._running.pop(ticket, (None, False))
        load = self._engines.get(engine) if engine is not None else None
        if load is None:
            return
        if ticket in load.prefilling:
            del load.prefilling[ticket]
        elif stream:
            load.decoding -= 1
        if load.decoding == 0 and not load.prefilling:
            del self._engines[engine]  # engines come and go with loads: keep none idle


class PrefillPlacement:
    """A line's placement with the prefill budget in front: a long cold prompt goes to
    the engine with the fewest running streams among those the budget lets it start on;
    any other ticket, and the slot on the chosen engine, are `inner`'s decision."""

    def __init__(self, inner: Placement, budget: PrefillBudget,
                 clock: Callable[[], float]) -> None:
        self.budget = budget
        self.inner = inner
        self._clock = clock
        #: Tickets the budget held at their last decision (their wait reason).
        self.held: set[object] = set()

    @property
    def inner(self) -> Placement:
        """The line's own policy: the budget asks it what the engines' caches hold
        (`Placement.cached_tokens`: nothing, unless it knows, as `KeepPrefixes` does),
        unless the budget was given its own knowledge."""
        return self._inner

    @inner.setter
    def inner(self, policy: Placement) -> None:
        self._inner = policy
        if not self.budget.cache_given:
            self.budget.cache = policy

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        budget = self.budget
        need = ticket.need
        # The common case first, without asking the cache: a short prompt.
        if need is None or need.prompt < budget.long_tokens:
            self.held.discard(ticket)
            return self.inner.place(ticket, engines)
        long = [budget.is_long(ticket, e) for e in engines]
        if not any(long):
            self.held.discard(ticket)
            return self.inner.place(ticket, engines)
        band, waited = _band_and_wait(ticket, self._clock())
        allowed = [e for e, is_long in zip(engines, long)
                   if not is_long or budget.admits(ticket, e, band=band, waited=waited)]
        if not allowed:
            if any(e.has_room(ticket.need) for e in engines):
                self.held.add(ticket)
            return None
        self.held.discard(ticket)
        if len(allowed) > 1 and all(long):
            # Cold everywhere: the engine where the fewest streams would feel it.
            fewest = min(budget.streams(e) for e in allowed)
            allowed = [e for e in allowed if budget.streams(e) == fewest]
        if len(allowed) < len(engines):
            home = self.inner.home_while_waiting(ticket, engines)
            if home is not None and home not in allowed:
                # The policy keeps it waiting for an engine left out here (a new
                # session's first prompt, long and cold, for the engine where the fewest
                # sessions live): it waits, within the policy's own bound.
                return None
        return self.inner.place(ticket, allowed)

    def forget(self, ticket: object) -> None:
        self.held.discard(ticket)

    def __repr__(self) -> str:
        return f"PrefillPlacement({self.inner!r})"


def _waiting_band(ticket: object) -> Band:
    """The band a ticket waits in: its own when it lowered it, else its flow's (as the
    fair queue has it); a probe (`Line.fits_now`: no ticket yet) is of the normal band."""
    flow = getattr(ticket, "flow", None)
    band = getattr(flow, "band", Band.NORMAL)
    own = getattr(ticket, "band", None)
    if own is not None and own > band:
        band = own
    return band if isinstance(band, Band) else Band.NORMAL


def _band_and_wait(ticket: Placeable, now: float) -> tuple[Band, float]:
    """A ticket's band and how long it has waited (a probe has not waited)."""
    enqueued = getattr(ticket, "enqueued_at", now)
    return _waiting_band(ticket), now - enqueued if isinstance(enqueued, (int, float)) else 0.0
