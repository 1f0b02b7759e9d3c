"""Whoever a share of the engines is owed to, and how urgently.

A `Flow` is a named key, or a client's address when there are no named keys: its weight
(its share beside the others of its band), its priority `Band` and how many of its
requests may run at once.  The fair queue orders waiters by them
(`backend.admission.fair_queue`); the keys' settings and the caller make them
(`backend.admission.flow_control`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["Band", "Flow"]


class Band(enum.IntEnum):
    """Priority bands; a smaller value goes first."""

    INTERACTIVE = 0
    NORMAL = 1
    BATCH = 2


@dataclass(frozen=True, slots=True)
class Flow:
    """Whoever a share is owed to: a key, or a client address without named keys."""

    key: str
    weight: float = 1.0
    band: Band = Band.NORMAL
    #: 0: no limit.  At the limit, the flow's requests wait in its own lanes.
    max_concurrent: int = 0

    def __post_init__(self) -> None:
        if (not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool)
                or not math.isfinite(self.weight) or self.weight <= 0):
            raise ValueError(f"a flow's weight is a positive number, not {self.weight!r}")
        if not _whole(self.max_concurrent) or self.max_concurrent < 0:
            raise ValueError("a flow's max_concurrent is a whole number, at least 0 "
                             f"(0: no limit), not {self.max_concurrent!r}")
        object.__setattr__(self, "band", Band(self.band))


def _whole(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)
