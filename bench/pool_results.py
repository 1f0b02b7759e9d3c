"""The pool benchmark's figures (`bench/pool.py` measures them, `bench/report.py` prints
them): one pool size's, and the real engines' part."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.load_generator import Run
from bench.scenarios import Scenario, Steady


@dataclass
class PoolResult:
    """The figures of one pool size."""

    engines: int
    throughput: dict[str, list[Run]] = field(default_factory=dict)
    #: Requests that found every slot of their engine busy and waited there, per target.
    waited: dict[str, int] = field(default_factory=dict)
    steady: Steady | None = None
    #: The port process's CPU per short request, seconds (one per round).
    port_cpu_per_request: list[float] = field(default_factory=list)


@dataclass
class RealResult:
    title: str
    pool: list[PoolResult]
    closed: Scenario | None
