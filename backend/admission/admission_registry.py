"""The admission's lines by model and its engines by key, and which engine is the current
one of each engine slot (a supervised or attached load whose successive processes replace
each other).  How a line admits is `backend.admission.line`; like it, this only decides.

    registry.activate(serving, model="tiny", engine="local:tiny")   # an engine joins
    ticket = registry.line("tiny").request(need)
    registry.retire("local:tiny")     # no new requests; its waiters wait for the next one
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from types import EllipsisType

from backend.listeners import Listeners
from backend.llama.kv_capacity import KvCapacity
from backend.llama.load import Serving
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.line import DEFAULT_MODEL, Clock, Line
from backend.admission.flow import Flow
from backend.admission.hash_ring import HashRing
from backend.admission.placement import KeepPrefixes, Placement
from backend.admission.session_book import Sessions

__all__ = ["AdmissionRegistry", "placement_named"]

log = logging.getLogger(__name__)


class AdmissionRegistry:
    """The lines by model and the engines by key; one current engine per engine slot."""

    def __init__(self, *,
                 max_waiting_for: Callable[[int], int] = lambda slots: max(64, 16 * slots),
                 enabled: bool = True, clock: Clock = time.monotonic,
                 placement_of: Callable[[str], str] = lambda model: KeepPrefixes.name) -> None:
        """`placement_of(model)`: the name of the placement policy of `model`'s line
        (`placement_named`), asked when its line is made and when the settings
        change (`refresh_placements`)."""
        self._max_waiting_for = max_waiting_for
        self._enabled = enabled
        self._clock = clock
        self._placement_of = placement_of
        #: The session book: every session's state, for every line's placement, the
        #: settlements, parking and the views.
        self.sessions = Sessions(clock=clock)
        # Insertion order is age; a queue made current is moved to the end.
        self._queues: dict[str, AdmissionQueue] = {}
        self._lines: dict[str, Line[AdmissionQueue]] = {}
        # Engine slot (a load whose processes replace each other) -> its current queue.
        self._current: dict[str, AdmissionQueue] = {}
        #: The engine slot `current` names: the default model's, in a pool.
        self.default_engine = ""
        self._listeners: Listeners[[]] = Listeners(log, "admission listener")
        # Set while several things change at once, so listeners hear one final state.
        self._batching = False

    # --- state -----------------------------------------------------------------------

    @property
    def current(self) -> AdmissionQueue | None:
        """The current queue of the default engine slot."""
        return self._current.get(self.default_engine)

    def current_of(self, engine: str) -> AdmissionQueue | None:
        return self._current.get(engine)

    @property
    def queues(self) -> list[AdmissionQueue]:
        """Every live queue, oldest first, the most recently activated last."""
        return list(self._queues.values())

    @property
    def lines(self) -> list[Line[AdmissionQueue]]:
        return list(self._lines.values())

    @property
    def total_active(self) -> int:
        return sum(queue.active for queue in self._queues.values())

    @property
    def total_waiting(self) -> int:
        return sum(line.waiting for line in self._lines.values())

    @property
    def total_held_by_prefill_budget(self) -> int:
        """Waiters the prefill budget holds, over every line."""
        return sum(line.held_by_prefill_budget for line in self._lines.values())

    @property
    def total_reserved_tokens(self) -> int:
        """KV tokens held by running requests, on every live engine."""
        return sum(queue.reserved_tokens for queue in self._queues.values())

    @property
    def kv_capacity(self) -> int:
        """KV tokens of every serving engine together, 0 while none is known."""
        return sum(queue.kv_capacity for queue in self._current.values())

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        with self._batch():
            for queue in list(self._queues.values()):
                queue.enabled = self._enabled

    def queue_for(self, key: str) -> AdmissionQueue | None:
        return self._queues.get(key)

    def find_line(self, model: str) -> Line[AdmissionQueue] | None:
        """The line of `model` if it exists (no line is made)."""
        return self._lines.get(model)

    def busy(self, model: str) -> bool:
        """Someone runs on, or waits for, an engine of `model` (retired ones included)."""
        line = self._lines.get(model)
        return line is not None and (line.busy or any(
            queue.line is line and queue.active for queue in self._queues.values()))

    def line(self, model: str = DEFAULT_MODEL) -> Line[AdmissionQueue]:
        """The line of `model`, made on first use."""
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = Line(model, max_waiting=self._max_waiting_for(1),
                                             clock=self._clock, on_change=self._line_changed,
                                             placement=self._placement(model))
        return line

    # --- lifecycle -------------------------------------------------------------------

    def activate(self, serving: Serving, *, model: str = DEFAULT_MODEL,
                 engine: str = "", label: str = "") -> AdmissionQueue:
        """The load in engine slot `engine` serves `model` as `serving` now: make its
        queue current there (`label`: the engine's public name, for the metrics).  The
        slot's previous queue retires (its running requests go on); the model's waiters
        may go to the new one, in their order of arrival.  Waiters that can never fit the
        model's engines now are refused with ContextLengthExceeded.
        """
        line = self.line(model)
        with self._batch():
            previous = self._current.get(engine)
            if previous is not None and previous.key != serving.key:
                previous.retire()
            queue = self._queues.pop(serving.key, None)
            if queue is None:
                queue = AdmissionQueue(serving, line=line, enabled=self._enabled,
                                       clock=self._clock, label=label)
            else:
                queue.serve(serving, line)
                queue.label = label
            self._queues[serving.key] = queue  # the newest last
            self._current[engine] = queue
            self._bound(line)
            self.prune()
        return queue

    def retire(self, engine: str = "") -> None:
        """The current load of slot `engine` is going away: it admits no one new, its
        running requests go on, its model's waiters wait for another engine."""
        queue = self._current.pop(engine, None)
        if queue is None:
            return
        with self._batch():
            queue.retire()
            self.prune()

    def retire_current(self) -> None:
        self.retire(self.default_engine)

    def carry(self, from_model: str, to_model: str) -> None:
        """Waiters for `from_model` now wait for `to_model`, in order of arrival."""
        if from_model != to_model and from_model in self._lines:
            with self._batch():
                self.line(to_model).take_waiters(self._lines[from_model])
                self.prune()

    def refuse_waiting(self, error: BaseException, model: str | None = None) -> int:
        """Refuse the waiters of every line no engine serves (or only `model`'s) with
        `error`; how many."""
        refused = 0
        with self._batch():
            for name, line in list(self._lines.items()):
                if (model is None or name == model) and not line.engines:
                    refused += line.refuse_waiting(error)
            self.prune()
        return refused

    def refuse_flow(self, key: str, error: BaseException) -> int:
        """Refuse every waiter of flow `key`, in every line (its key was revoked or has
        expired); how many."""
        with self._batch():
            return sum(line.refuse_flow(key, error) for line in list(self._lines.values()))

    def waiting_flows(self) -> set[str]:
        """The flows with a request waiting, in any line or for a model to load
        (O(waiters))."""
        return {ticket.flow.key for line in self._lines.values() for ticket in line}.union(
            *(line.awaiting_flows() for line in self._lines.values()))

    def update_flow(self, flow: Flow) -> None:
        """A key was edited: its weight, band and concurrency apply in every line now."""
        with self._batch():
            for line in list(self._lines.values()):
                line.update_flow(flow)

    def prune(self) -> None:
        """Forget retired queues with nothing running, and lines with neither engines,
        waiters nor running requests."""
        self._prune_retired()
        in_use = {id(queue.line) for queue in self._queues.values()}
        for model, line in list(self._lines.items()):
            if not line.engines and not line.waiting and id(line) not in in_use:
                del self._lines[model]
        self._notify()

    def set_capacity(self, n: int, kv: KvCapacity | None | EllipsisType = ...,
                     engine: str = "") -> None:
        """The current load of slot `engine` re-read its slots (and cache, unless
        omitted).  Without a current load there: nothing."""
        queue = self._current.get(engine)
        if queue is None:
            return
        with self._batch():
            queue.set_capacity(n, kv)
            self._bound(queue.line)

    def refresh_bounds(self) -> None:
        """The settings changed: every line's bound again."""
        with self._batch():
            for line in self._lines.values():
                self._bound(line)

    def refresh_placements(self) -> None:
        """The settings changed: a line whose policy the operator named another (as
        `placement_of` says now) takes the new one; a policy set by hand stays."""
        for model, line in self._lines.items():
            policy = line.placement
            if policy.name and policy.name != self._placement_of(model):
                line.placement = self._placement(model)
                line.admit_waiting()

    # --- listeners -------------------------------------------------------------------

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after every change of counts.  Its errors are logged only."""
        self._listeners.add(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.remove(callback)

    def __repr__(self) -> str:
        return f"<AdmissionRegistry {self.queues!r} {self.lines!r}>"

    # --- helpers ---------------------------------------------------------------------

    def _placement(self, model: str) -> Placement:
        return placement_named(self._placement_of(model), self.sessions, clock=self._clock)

    def _bound(self, line: Line[AdmissionQueue]) -> None:
        if line.engines:
            line.max_waiting = self._max_waiting_for(line.capacity)

    def _line_changed(self, line: Line[AdmissionQueue]) -> None:
        """Every change of counts: cheap, it runs for every request."""
        if not self._batching:
            self._prune_retired()
            self._listeners()

    def _prune_retired(self) -> None:
        if len(self._queues) > len(self._current):  # some are retired
            for key, queue in list(self._queues.items()):
                if queue.retired and queue.active == 0:
                    del self._queues[key]

    def _notify(self) -> None:
        if not self._batching:
            self._listeners()

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        """Hold listener calls back until the outermost batch ends, then call them once."""
        if self._batching:
            yield
            return
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            self.prune()


def placement_named(name: str, sessions: Sessions, *,
                    clock: Callable[[], float] = time.monotonic) -> Placement:
    """A new policy of `name` ("keep-prefixes": `KeepPrefixes`, "hash-ring": `HashRing`;
    `backend.settings.PLACEMENTS`) over the session book `sessions`."""
    if name == HashRing.name:
        return HashRing(sessions)
    if name == KeepPrefixes.name:
        return KeepPrefixes(sessions, clock=clock)
    raise ValueError(f"There is no placement policy named {name!r}.")
