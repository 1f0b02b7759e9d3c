"""The fair queue's books: its items, lanes, flows and bands, and the lazy walk of a band's
heaps in key order.

A flow's waiting items of one band form a `Lane`, in arrival order, with a virtual start
tag (its service in tokens / weight); a band (`BandState`) keeps its clocks and its heaps
of listed lanes (by tag, and by how long each head has waited).  Heap entries are never
removed in place: a lane's `version` goes up when it is re-keyed, and an entry of an
older version is stale, skipped as the heap is read (`first_current`, `in_order`).  Only
`backend.admission.fair_queue` writes them.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from backend.admission.flow import Band, Flow

__all__ = ["BandState", "Entry", "FlowState", "HeapEntry", "Lane", "aged", "by_seq",
           "first_current", "head_of", "in_order", "is_current"]

T = TypeVar("T", bound=Hashable)

#: key, slots its flow held when listed (order heap; 0 in the age heap), head seq, tie,
#: lane, version.
HeapEntry = tuple[float, int, int, int, "Lane[T]", int]


class Entry(Generic[T]):
    """One item, waiting or running."""

    __slots__ = ("item", "flow", "band", "cost", "seq", "enqueued_at", "weight", "passes",
                 "discount")

    def __init__(self, item: T, flow: FlowState[T], band: Band, cost: int, seq: int,
                 enqueued_at: float) -> None:
        self.item = item
        self.flow = flow
        self.band = band
        self.cost = cost
        self.seq = seq
        self.enqueued_at = enqueued_at
        #: The flow's weight when it was admitted: a refund or requeue undoes its
        #: charge at the same rate.
        self.weight = flow.flow.weight
        #: Admissions that passed it while it was a head that did not fit.
        self.passes = 0
        #: Tokens of its cost not charged to its flow (the engine's cache held them).
        self.discount = 0


class Lane(Generic[T]):
    """A flow's waiting items of one band, in seq order, and its service tag."""

    __slots__ = ("flow", "band", "items", "vtime", "head_since", "version", "listed")

    def __init__(self, flow: FlowState[T], band: Band, vtime: float) -> None:
        self.flow = flow
        self.band = band
        self.items: OrderedDict[T, Entry[T]] = OrderedDict()
        #: Virtual start tag: service in tokens / weight, caught up on backlogging.
        self.vtime = vtime
        self.head_since = 0.0
        #: Bumped on every change of key: heap entries of an older version are stale.
        self.version = 0
        #: In its band's heaps: has waiters and its flow is under max_concurrent.
        self.listed = False


class FlowState(Generic[T]):
    __slots__ = ("flow", "lanes", "running", "reserved", "waiting")

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.lanes: dict[Band, Lane[T]] = {}
        self.running = 0
        self.reserved = 0
        self.waiting = 0


class BandState(Generic[T]):
    __slots__ = ("vtime", "paid", "aged_vtime", "order", "age", "idle", "listed", "weight",
                 "backlogged")

    def __init__(self) -> None:
        #: SFQ's virtual time: the largest start tag admitted.
        self.vtime = 0.0
        #: Processor-sharing virtual time (>= vtime): idle lanes tagged below it owe
        #: nothing and are dropped.
        self.paid = 0.0
        #: The tag of the heads lifted into this band, competing as one flow.
        self.aged_vtime = 0.0
        self.order: list[HeapEntry[T]] = []  # listed lanes by (tag, head seq)
        self.age: list[HeapEntry[T]] = []  # listed lanes by (head since, head seq)
        self.idle: list[tuple[float, int, Lane[T], int]] = []  # by tag, still owing
        self.listed = 0
        self.weight = 0.0  # of the listed lanes' flows
        self.backlogged = 0  # lanes with waiters, listed or at their flow's limit


def head_of(lane: Lane[T]) -> Entry[T]:
    return lane.items[next(iter(lane.items))]


def is_current(entry: HeapEntry[T]) -> bool:
    lane = entry[4]
    return lane.listed and lane.version == entry[5]


def first_current(heap: list[HeapEntry[T]]) -> HeapEntry[T] | None:
    """The current entry with the smallest key (stale ones on top are dropped)."""
    while heap and not is_current(heap[0]):
        heapq.heappop(heap)
    return heap[0] if heap else None


def in_order(heap: list[HeapEntry[T]]) -> Iterator[HeapEntry[T]]:
    """The current entries of `heap` in key order, leaving the heap as it is (only
    stale entries on top are dropped).  O(log n) per entry."""
    if first_current(heap) is None:
        return
    frontier: list[tuple[HeapEntry[T], int]] = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        entry, index = heapq.heappop(frontier)
        if is_current(entry):
            yield entry
        for child in (2 * index + 1, 2 * index + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))


def aged(heap: list[HeapEntry[T]], since: float) -> Iterator[HeapEntry[T]]:
    """Current entries of an age heap whose head has waited since `since` or earlier."""
    for entry in in_order(heap):
        if entry[0] > since:
            return
        yield entry


def by_seq(entry: Entry[T]) -> int:
    return entry.seq
