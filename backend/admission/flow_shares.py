"""A room shared by flows: what each flow keeps per session, within a capacity and each
flow's share of it.

The session book (`backend.admission.session_book`) keeps its sessions, and their last
requests' bodies, of every key (flow) in one bounded room.  Least recently used
first alone, one key that names a new session per request would push every other key's
sessions out.  So here a flow holds at most `share` units (past it, its own least
recently used go first), and past the room's `capacity` the least recently used key of
the flow that holds the most goes: a flow never loses a key to make room for one that
holds more than it does.  Units are what the room counts: sessions, or bytes.

Pure: no I/O, no clock, no locks.  `put`, `touch` and `discard` are O(1) but for what
`put` drops; each key dropped past the capacity costs O(flows).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["FlowShares", "default_share"]

K = TypeVar("K", bound=Hashable)


def default_share(capacity: int) -> int:
    """A flow's share of a room of `capacity` units by default: a quarter (at least one
    unit), so that a key with a few hundred live sessions keeps them all, and one key
    alone never fills a room that the others use."""
    return max(1, capacity // 4)


class FlowShares(Generic[K]):
    """Keys of flows, least recently used first, within `capacity` units together and
    `share` units per flow (`default_share` when None)."""

    def __init__(self, capacity: int, share: int | None = None) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity is a whole number, at least 1, not {capacity!r}")
        share = default_share(capacity) if share is None else share
        if not isinstance(share, int) or isinstance(share, bool) or share < 1:
            raise ValueError(f"share is a whole number, at least 1, not {share!r}")
        self.capacity = capacity
        self.share = min(share, capacity)
        # Flow -> its keys, least recently used first, with their units and when used.
        self._flows: dict[str, OrderedDict[K, tuple[int, int]]] = {}
        self._flow_of: dict[K, str] = {}
        self._units: dict[str, int] = {}
        self._total = 0
        self._ticks = itertools.count()

    def __len__(self) -> int:
        return len(self._flow_of)

    def __contains__(self, key: object) -> bool:
        return key in self._flow_of

    @property
    def units(self) -> int:
        """Units held by every flow together."""
        return self._total

    def units_of(self, flow: str) -> int:
        return self._units.get(flow, 0)

    def keys_of(self, flow: str) -> Iterator[K]:
        """`flow`'s keys, least recently used first."""
        return iter(list(self._flows.get(flow, ())))

    def flows(self) -> list[str]:
        """The flows holding any key."""
        return list(self._flows)

    def put(self, flow: str, key: K, units: int = 1) -> list[K]:
        """`key` of `flow` was used now, holding `units` (instead of what it held); the
        keys dropped to keep within the share and the capacity, least recently used
        first.  A key more than a share alone is not held (nothing else goes for it):
        then it is the one dropped."""
        self.discard(key)
        if units > self.share:
            return [key]
        keys = self._flows.setdefault(flow, OrderedDict())
        keys[key] = (units, next(self._ticks))
        self._flow_of[key] = flow
        self._units[flow] = self._units.get(flow, 0) + units
        self._total += units
        dropped: list[K] = []
        while self._units.get(flow, 0) > self.share:
            dropped.append(self._drop_oldest(flow))
        while self._total > self.capacity:
            dropped.append(self._drop_oldest(self._fullest()))
        return dropped

    def touch(self, key: K) -> None:
        """`key` was used now (holding what it held)."""
        flow = self._flow_of.get(key)
        if flow is not None:
            keys = self._flows[flow]
            keys[key] = (keys[key][0], next(self._ticks))
            keys.move_to_end(key)

    def discard(self, key: K) -> None:
        """Forget `key`, if held."""
        flow = self._flow_of.pop(key, None)
        if flow is None:
            return
        keys = self._flows[flow]
        units, _ = keys.pop(key)
        self._release(flow, units)

    # --- helpers ---------------------------------------------------------------------

    def _fullest(self) -> str:
        """The flow holding the most units; of those, the one whose least recently used
        key was used longest ago."""
        return max(self._flows, key=lambda flow: (self._units[flow],
                                                  -next(iter(self._flows[flow].values()))[1]))

    def _drop_oldest(self, flow: str) -> K:
        keys = self._flows[flow]
        key, (units, _) = keys.popitem(last=False)
        del self._flow_of[key]
        self._release(flow, units)
        return key

    def _release(self, flow: str, units: int) -> None:
        self._total -= units
        self._units[flow] -= units
        if not self._flows[flow]:
            del self._flows[flow]
            del self._units[flow]
