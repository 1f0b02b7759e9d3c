"""Who goes next among the waiters of one model: priority bands, a fair share between
flows inside a band, first come first served inside a flow.

A *flow* is whoever a share is owed to: a named key, or a client address when there are
no named keys (`Flow`, `backend.admission.flow`; the lanes and bands the queue keeps are
its books, `backend.admission.lanes`).  Each request is an item with a *cost*, the KV
tokens it reserves (at least 1, so that a request of unknown size still counts).  The admission asks
`next_to_admit(fits)` whenever room may have freed; `fits` says whether some engine has
a slot and the tokens for an item right now.

Bands: interactive before normal before batch.  A flow has a band; a request may lower
its own (never raise it).  A flow's requests of one band form a *lane*, first come first
served; a request that lowered its band waits in the flow's lower lane, so it holds back
none of the flow's own higher-priority requests.  Aging bounds a lower band's wait: a
lane's head that has been the head for `aging` seconds is *lifted* one band, two bands
after twice that.  Lifted heads compete in the higher band as one more flow of weight
`AGED_WEIGHT` (oldest head first among them): a lower band gets a bounded share of a
busy higher band, never all of it, however many of its lanes have aged.  Aging counts
from when an item became its lane's head, not from its arrival, and it only lifts over a
band that has waiters: inside a band the fair order alone decides.

Fair share inside a band: start-time fair queuing (SFQ, Goyal et al. 1996) on reserved
tokens, less those the engine's prompt cache holds (`discount`: a warm agent is not
billed for the prefix it reuses, nor gains from it beyond its share: each request is
still charged at least 1 token, and its output budget and uncached prompt in full).  Each lane has a virtual start tag, its service so far in tokens divided by its
flow's weight; the band's virtual time is the largest start tag admitted yet.  The lane
with the smallest tag goes next (ties: the older head), and is charged cost/weight when
admitted.  A lane that becomes backlogged (or eligible again after its flow was at its
`max_concurrent`) starts at max(its tag, the band's virtual time): a flow cannot bank
credit while it has nothing waiting, and a newcomer is served next rather than behind
anyone's backlog.  Why not deficit round robin: costs range from tens to tens of
thousands of tokens, and DRR is only O(1) when its quantum is at least the largest cost,
so it serves each flow in bursts of up to a quantum: a newcomer waits behind a whole
quantum of every backlogged flow, where SFQ admits it next (bench/fairness_core.py
measures both).  SFQ costs O(log F) heap operations per admission instead.

KV fit: the first head in that order that fits is admitted.  Each head tried before it
that did not fit has been *passed* once; a head passed `max_passes` times is a barrier:
nothing behind it in the order is admitted until it fits (those ahead of it still go).
Running requests end, so it does fit, and no head is passed more than `max_passes`
times.  `max_passes=0` is the strict rule of a FIFO line (only the first in order may
go).  Inside a lane the order is first come first served, except behind a head that
waits for room its lane's next items would not take (`next_to_admit`'s
`waits_elsewhere`: its session's engine, while they go to others): they may pass it,
each admission one pass of the same bound.  With a single flow in a single band there is one lane and nobody to pass: the
order is exactly first come, first served.

State stays bounded: a lane with nothing waiting is kept only while it owes service,
so that a flow coming back soon after a large request still pays for it.  It owes while
its tag is ahead of the band's *paid* time, a processor-sharing (GPS) clock that
advances by cost / the backlogged weight on each admission and, as in GPS, never passes
the finish tag of the least served lane still waiting.  Every idle lane of a band is
dropped when the band has no one waiting, and a flow when it has no lane and nothing
running.

Pure: no I/O, no asyncio, no locks.  `fits` must not change the queue.  Costs:
`push`, `remove`, `finished`, `refund`: O(log F) (F = backlogged lanes);
`next_to_admit`: O(log F) when the first candidate fits, O(k log F) when k do not
(k <= `max_scan`); `requeue`: O(n) in the lane; `position`, `__iter__`: O(n log n).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from backend.admission.flow import Band, Flow
from backend.admission.lanes import (BandState, Entry, FlowState, Lane, aged, by_seq,
                                     first_current, head_of, in_order, is_current)

__all__ = ["AGED_WEIGHT", "FairQueue"]

T = TypeVar("T", bound=Hashable)

#: The weight lifted heads compete with, together, in the band they were lifted into.
AGED_WEIGHT = 1.0


class FairQueue(Generic[T]):
    """The waiters of one model: who should be admitted next, and what each flow holds."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 aging: float = 30.0, max_passes: int = 4, max_scan: int = 8) -> None:
        """`aging`: seconds as a lane's head per band lifted (math.inf: never).
        `max_passes`: how often a head that does not fit may be passed before nothing
        behind it is admitted.  `max_scan`: heads that do not fit tried per call beyond
        the first."""
        if not aging > 0:
            raise ValueError(f"aging is a positive number of seconds, not {aging!r}")
        for name, value in (("max_passes", max_passes), ("max_scan", max_scan)):
            if not _whole(value) or value < 0:
                raise ValueError(f"{name} is a whole number, at least 0, not {value!r}")
        self._clock = clock
        self._aging = float(aging)
        self._max_passes = max_passes
        self._max_scan = max_scan
        self._flows: dict[str, FlowState[T]] = {}
        self._waiting: dict[T, Entry[T]] = {}
        self._running: dict[T, Entry[T]] = {}
        self._bands = tuple(BandState[T]() for _ in Band)
        self._ties = itertools.count()

    # --- state -----------------------------------------------------------------------

    def __len__(self) -> int:
        """Items waiting (running ones are not in line)."""
        return len(self._waiting)

    def __contains__(self, item: object) -> bool:
        return item in self._waiting

    def __iter__(self) -> Iterator[T]:
        """The waiting items in arrival order (by seq): for carry-over and diagnostics."""
        return iter([e.item for e in sorted(self._waiting.values(), key=by_seq)])

    def waiting_of(self, flow_key: str) -> int:
        state = self._flows.get(flow_key)
        return 0 if state is None else state.waiting

    def running_of(self, flow_key: str) -> int:
        """Items of the flow admitted and not finished."""
        state = self._flows.get(flow_key)
        return 0 if state is None else state.running

    def running_flows(self) -> set[str]:
        """The flows with an item running (O(running))."""
        return {entry.flow.flow.key for entry in self._running.values()}

    def reserved_of(self, flow_key: str) -> int:
        """Tokens the flow's running items reserve (their costs, less refunds)."""
        state = self._flows.get(flow_key)
        return 0 if state is None else state.reserved

    @property
    def tracked_flows(self) -> int:
        """Flows the queue keeps state for: waiting, running, or still owing service."""
        return len(self._flows)

    def position(self, item: T) -> int | None:
        """0-based place in the order the waiters would be admitted if each fitted when
        its turn came, nothing arrived and nothing finished: an estimate for Retry-After
        and diagnostics, O(n log n).  None when `item` is not waiting.  With a single
        flow in a single band it is the place in the FIFO line."""
        if item not in self._waiting:
            return None
        now = self._clock()
        with_waiters = {band for band, state in enumerate(self._bands) if state.backlogged}
        ties = itertools.count()
        heap: list[tuple[int, int, float, int, int, int, list[Entry[T]], float]] = []
        for flow in self._flows.values():
            for lane in flow.lanes.values():
                if not lane.items:
                    continue
                entries = list(lane.items.values())
                tag = max(lane.vtime, self._bands[lane.band].vtime)
                lifted = self._lifted_band(lane, now, with_waiters)
                if lifted < lane.band:
                    key = (lifted, 0, lane.head_since, entries[0].seq)
                else:
                    key = (lane.band, 1, tag, entries[0].seq)
                heap.append((*key, next(ties), 0, entries, tag))
        heapq.heapify(heap)
        place = 0
        while heap:
            _, _, _, _, _, index, entries, tag = heapq.heappop(heap)
            entry = entries[index]
            if entry.item == item:
                return place
            place += 1
            tag += entry.cost / entry.flow.flow.weight
            if index + 1 < len(entries):
                heapq.heappush(heap, (entry.band, 1, tag, entries[index + 1].seq,
                                      next(ties), index + 1, entries, tag))
        return None  # unreachable: item is waiting

    # --- changes ---------------------------------------------------------------------

    def push(self, item: T, flow: Flow, cost: int, seq: int,
             band: Band | None = None) -> None:
        """`item` of `flow` waits now.  `cost`: the KV tokens it reserves (at least 1).
        `seq`: arrival order (items of one lane are kept in seq order).  `band` may
        lower the flow's band for this item, never raise it.  A changed `flow` (weight,
        band, max_concurrent) for a known key applies from now on."""
        if item in self._waiting or item in self._running:
            raise ValueError(f"{item!r} is already in the queue")
        cost = _check_cost(cost)
        state = self._flow_state(flow)
        lane_band = flow.band if band is None else max(flow.band, Band(band))
        lane = state.lanes.get(lane_band)
        if lane is None:
            lane = state.lanes[lane_band] = Lane(state, lane_band,
                                                 self._bands[lane_band].vtime)
        now = self._clock()
        entry = Entry(item, state, lane_band, cost, seq, now)
        self._waiting[item] = entry
        state.waiting += 1
        self._insert(lane, entry, now)

    def update_flow(self, flow: Flow) -> None:
        """A key was edited: its weight and max_concurrent apply now (a lower limit
        lets running items finish), its band to requests pushed from now on.  Nothing
        when the queue holds nothing of that key."""
        if flow.key in self._flows:
            self._flow_state(flow)

    def remove(self, item: T) -> None:
        """A waiting item left the line (timed out, client gone, refused).  KeyError
        if it is not waiting."""
        entry = self._waiting.pop(item)
        state = entry.flow
        lane = state.lanes[entry.band]
        was_head = head_of(lane) is entry
        del lane.items[item]
        state.waiting -= 1
        if was_head:
            lane.head_since = self._clock()
            self._rekey(lane)
        if not lane.items:
            self._emptied(lane)

    def next_to_admit(self, fits: Callable[[T], bool],
                      waits_elsewhere: Callable[[T], bool] | None = None) -> T | None:
        """The item to admit now, or None; it leaves the line and its flow is charged.

        `fits(item)`: is there room for it right now.  It must not change the queue.
        `waits_elsewhere(item)`: a head that does not fit waits for room that items
        behind it in its own lane would not take (its session's engine, while they go
        to others): they may pass it, each admission one pass, within `max_passes`.
        Ask only while some engine has a free slot: when nothing can fit, each item
        tried costs a `fits` call and a step down the heap, up to `max_scan` + 1.
        """
        if not self._waiting:
            return None
        now = self._clock()
        missed: list[Entry[T]] = []
        for lane, lifted_into in self._candidates(now):
            entry = head_of(lane)
            if fits(entry.item):
                for passed in missed:
                    passed.passes += 1
                return self._admit(entry, now, lifted_into)
            if entry.passes >= self._max_passes:
                return None  # nothing passes it any more
            missed.append(entry)
            if waits_elsewhere is not None and waits_elsewhere(entry.item):
                # Its own lane's next ones, in order, while each waits elsewhere too.
                for behind in itertools.islice(lane.items.values(), 1, None):
                    if len(missed) > self._max_scan:
                        return None
                    if fits(behind.item):
                        for passed in missed:
                            passed.passes += 1
                        return self._admit(behind, now, lifted_into)
                    if behind.passes >= self._max_passes or not waits_elsewhere(behind.item):
                        break
                    missed.append(behind)
            if len(missed) > self._max_scan:
                return None
        return None

    def finished(self, item: T) -> None:
        """A running item ended: its flow's slot under max_concurrent and its tokens
        are free.  Its service stays charged.  KeyError if it is not running."""
        entry = self._running.pop(item)
        state = entry.flow
        state.running -= 1
        state.reserved -= entry.cost
        self._refresh(state)
        self._forget_if_done(state)

    def refund(self, item: T, tokens: int) -> None:
        """`item`'s reservation shrank by `tokens` (its prompt was counted): a waiting
        item will cost less; a running one holds less and its flow is charged less.
        The cost stays at least 1.  KeyError if the item is neither waiting nor running."""
        entry = self._waiting.get(item) or self._running[item]
        if not _whole(tokens) or tokens < 0 or tokens >= entry.cost:
            raise ValueError(f"a refund is a whole number of tokens below the cost "
                             f"({entry.cost}), not {tokens!r}")
        if tokens == 0:
            return
        charged = entry.cost - entry.discount
        entry.cost -= tokens
        if item in self._waiting:
            return
        entry.discount = min(entry.discount, entry.cost - 1)
        state = entry.flow
        state.reserved -= tokens
        self._uncharge(entry, charged - (entry.cost - entry.discount))

    def discount(self, item: T, tokens: int) -> None:
        """A running item's flow is charged `tokens` fewer: the engine's cache holds
        that much of its prompt (its reservation is unchanged).  Each item is still
        charged at least 1.  KeyError if the item is not running."""
        entry = self._running[item]
        if not _whole(tokens) or tokens < 0:
            raise ValueError(f"a discount is a whole number of tokens, not {tokens!r}")
        tokens = min(tokens, entry.cost - 1 - entry.discount)
        if tokens <= 0:
            return
        entry.discount += tokens
        self._uncharge(entry, tokens)

    def requeue(self, item: T) -> None:
        """A running item goes back to its arrival place in its lane, uncharged (the
        engine refused it before it was served).  KeyError if it is not running."""
        entry = self._running.pop(item)
        state = entry.flow
        state.running -= 1
        state.reserved -= entry.cost
        lane = state.lanes.get(entry.band)
        if lane is None:
            lane = state.lanes[entry.band] = Lane(state, entry.band,
                                                  self._bands[entry.band].vtime)
        else:
            lane.vtime -= (entry.cost - entry.discount) / entry.weight
        entry.discount = 0
        self._waiting[item] = entry
        state.waiting += 1
        self._insert(lane, entry, entry.enqueued_at)
        if lane.listed:
            self._rekey(lane)  # its tag went back
        self._refresh(state)

    # --- helpers ---------------------------------------------------------------------

    def _uncharge(self, entry: Entry[T], tokens: int) -> None:
        """Take `tokens` of a running entry's charge back from its lane's tag."""
        lane = entry.flow.lanes.get(entry.band)
        if lane is None or tokens <= 0:  # forgotten since: it owed nothing, still owes nothing
            return
        lane.vtime -= tokens / entry.weight
        if lane.listed:
            self._rekey(lane)
        elif not lane.items and lane.vtime <= self._bands[lane.band].paid:
            self._drop_lane(lane)

    def _flow_state(self, flow: Flow) -> FlowState[T]:
        state = self._flows.get(flow.key)
        if state is None:
            state = self._flows[flow.key] = FlowState(flow)
        elif state.flow != flow:
            old, state.flow = state.flow, flow
            for lane in state.lanes.values():
                if lane.listed:
                    self._bands[lane.band].weight += flow.weight - old.weight
            self._refresh(state)
        return state

    def _insert(self, lane: Lane[T], entry: Entry[T], head_since: float) -> None:
        items = lane.items
        was_empty = not items
        if was_empty or entry.seq > items[next(reversed(items))].seq:
            items[entry.item] = entry
        else:
            ordered = sorted([*items.values(), entry], key=by_seq)
            items.clear()
            items.update((e.item, e) for e in ordered)
        if was_empty:
            self._bands[lane.band].backlogged += 1
        if head_of(lane) is entry:
            lane.head_since = head_since
            self._rekey(lane)

    def _eligible(self, state: FlowState[T]) -> bool:
        limit = state.flow.max_concurrent
        return limit == 0 or state.running < limit

    def _rekey(self, lane: Lane[T]) -> None:
        """List `lane` under its current tag and head, or unlist it (O(log F))."""
        band = self._bands[lane.band]
        lane.version += 1
        listed = bool(lane.items) and self._eligible(lane.flow)
        if listed and not lane.listed:
            # Backlogged, or eligible, again: no credit from the time it was not.
            lane.vtime = max(lane.vtime, band.vtime)
            lane.listed = True
            band.listed += 1
            band.weight += lane.flow.flow.weight
        elif not listed and lane.listed:
            lane.listed = False
            band.listed -= 1
            band.weight = band.weight - lane.flow.flow.weight if band.listed else 0.0
        if not listed:
            return
        head = head_of(lane)
        tie = next(self._ties)
        # Equal tags: the flow holding fewer slots first, then the older head (a newcomer
        # and a flow whose every request was admitted at once start even: it goes first).
        heapq.heappush(band.order, (lane.vtime, lane.flow.running, head.seq, tie, lane,
                                    lane.version))
        if lane.band != Band.INTERACTIVE:
            heapq.heappush(band.age, (lane.head_since, 0, head.seq, tie, lane, lane.version))
        # Entries of earlier keys are skipped lazily; rebuild before they dominate.
        bound = 2 * band.listed + 32
        if len(band.order) > bound:
            band.order = [e for e in band.order if is_current(e)]
            heapq.heapify(band.order)
        if len(band.age) > bound:
            band.age = [e for e in band.age if is_current(e)]
            heapq.heapify(band.age)

    def _refresh(self, state: FlowState[T]) -> None:
        """List or unlist the flow's lanes after its running count or limit changed."""
        eligible = self._eligible(state)
        for lane in list(state.lanes.values()):
            if lane.listed != (eligible and bool(lane.items)):
                self._rekey(lane)

    def _admit(self, entry: Entry[T], now: float, lifted_into: int | None) -> T:
        state = entry.flow
        lane = state.lanes[entry.band]
        band = self._bands[entry.band]
        was_head = head_of(lane) is entry
        item = entry.item
        del lane.items[item]
        del self._waiting[item]
        state.waiting -= 1
        state.running += 1
        state.reserved += entry.cost
        self._running[item] = entry
        start = lane.vtime
        entry.weight = state.flow.weight
        lane.vtime = start + entry.cost / entry.weight
        band.vtime = max(band.vtime, start)
        paid = band.paid + entry.cost / band.weight  # the weight of everyone listed
        if lifted_into is not None:
            higher = self._bands[lifted_into]
            aged_start = max(higher.aged_vtime, higher.vtime)
            higher.aged_vtime = aged_start + entry.cost / AGED_WEIGHT
            higher.vtime = max(higher.vtime, aged_start)
            higher.paid = max(higher.paid, higher.vtime)
        if was_head:
            lane.head_since = now
        self._rekey(lane)
        self._refresh(state)
        # A processor-sharing clock: how far every backlogged lane's debt is paid.  It
        # never passes the finish tag of the least served lane still waiting, as in GPS.
        least = first_current(band.order)
        if least is not None:
            paid = min(paid, least[0] + head_of(least[4]).cost / least[4].flow.flow.weight)
        band.paid = max(band.paid, band.vtime, paid)
        idle = band.idle
        while idle and idle[0][0] <= band.paid:
            _, _, owing, version = heapq.heappop(idle)
            if owing.version == version and not owing.items:
                self._drop_lane(owing)
        if not lane.items:
            self._emptied(lane)
        return item

    def _emptied(self, lane: Lane[T]) -> None:
        """`lane` has nothing waiting any more (it is unlisted already)."""
        band = self._bands[lane.band]
        band.backlogged -= 1
        if band.backlogged == 0:
            # No one waits in this band: as in SFQ's idle system, everyone starts even.
            owing = [lane, *(e[2] for e in band.idle if e[2].version == e[3])]
            top = max(o.vtime for o in owing)
            band.vtime = band.paid = band.aged_vtime = max(band.vtime, band.paid, top)
            band.idle.clear()
            for idle in owing:
                if not idle.items and idle.flow.lanes.get(idle.band) is idle:
                    self._drop_lane(idle)
        elif lane.vtime <= band.paid:
            self._drop_lane(lane)
        else:
            heapq.heappush(band.idle, (lane.vtime, next(self._ties), lane, lane.version))

    def _drop_lane(self, lane: Lane[T]) -> None:
        lane.version += 1
        state = lane.flow
        del state.lanes[lane.band]
        self._forget_if_done(state)

    def _forget_if_done(self, state: FlowState[T]) -> None:
        if not state.lanes and not state.running and not state.waiting:
            if self._flows.get(state.flow.key) is state:
                del self._flows[state.flow.key]

    def _candidates(self, now: float) -> Iterator[tuple[Lane[T], int | None]]:
        """Listed lanes in the order their heads should go, lazily, each with the band
        it was lifted into (None: it competes in its own band)."""
        bands = self._bands
        seen: set[Lane[T]] = set()
        for level, band in enumerate(bands):
            if not band.listed:
                continue
            lifted = self._lifted(level, now, seen)
            first = next(lifted, None)
            if first is None:
                for entry in in_order(band.order):
                    if entry[4] not in seen:
                        seen.add(entry[4])
                        yield entry[4], None
                continue
            # The lifted heads are one more flow of this band: they go at its tag.
            aged_tag = max(band.aged_vtime, band.vtime)
            natives = in_order(band.order)
            for entry in natives:
                if entry[0] >= aged_tag:
                    natives = itertools.chain((entry,), natives)
                    break
                if entry[4] not in seen:
                    seen.add(entry[4])
                    yield entry[4], None
            seen.add(first)
            yield first, level
            for lane in lifted:
                seen.add(lane)
                yield lane, level
            for entry in natives:
                if entry[4] not in seen:
                    seen.add(entry[4])
                    yield entry[4], None

    def _lifted(self, level: int, now: float, seen: set[Lane[T]]) -> Iterator[Lane[T]]:
        """Lanes of lower bands whose head has aged into `level`, oldest head first."""
        if self._aging == math.inf:
            return
        bands = self._bands
        streams = [aged(bands[lower].age, now - (lower - level) * self._aging)
                   for lower in range(level + 1, len(bands)) if bands[lower].listed]
        if not streams:
            return
        for entry in streams[0] if len(streams) == 1 else heapq.merge(*streams):
            if entry[4] not in seen:
                yield entry[4]

    def _lifted_band(self, lane: Lane[T], now: float, with_waiters: set[int]) -> int:
        """The band `lane`'s head competes in now, by aging over bands with waiters."""
        waited = now - lane.head_since
        for level in range(lane.band):
            if level in with_waiters and waited >= (lane.band - level) * self._aging:
                return level
        return lane.band


def _check_cost(cost: int) -> int:
    if not _whole(cost) or cost < 1:
        raise ValueError(f"a cost is a whole number of tokens, at least 1, not {cost!r}")
    return cost


def _whole(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)
