"""The relay benchmark's scenarios: one load run against every target in turn, round by
round, and the steady state (newcomers arriving while streams already flow); the
figures over rounds (medians, quantiles) that the report prints.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from bench.load_generator import Run, StreamClient, chat_request, run_load, start_stream
from bench.processes import CpuMeter, Target, get_json


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Scenario:
    title: str
    streams: int
    tokens: int
    body: bytes
    upstream_pid: int
    targets: list[Target]
    expect_tokens: int | None
    timeout: float
    spread: float = 0.0
    judged: bool = True
    runs: dict[str, list[Run]] = field(default_factory=dict)
    requests: int = 1  # per client, one after the other on its connection (a closed loop)

    def throughput_ratios(self, name: str, base: str = "direct") -> list[float]:
        return [a.rate / b.rate for a, b in zip(self.runs[name], self.runs[base]) if b.rate]

    def added_ttft(self, name: str, q: float, base: str = "direct") -> list[float]:
        return [quantile(a.ttfts, q) - quantile(b.ttfts, q)
                for a, b in zip(self.runs[name], self.runs[base])]

    def cpu_per_chunk(self, name: str, who: str) -> float:
        return median([r.cpu[who] / r.chunks * 1e6 for r in self.runs[name]
                       if r.chunks and who in r.cpu])

    def errors(self) -> int:
        return sum(r.errors for runs in self.runs.values() for r in runs)


async def run_scenario(scenario: Scenario, rounds: int, log: Callable[[str], None]) -> Scenario:
    """One warm-up run per target, then `rounds` rounds of every target in turn."""
    for target in scenario.targets:
        await run_load(target, scenario.upstream_pid, scenario.streams, scenario.body,
                       scenario.expect_tokens, scenario.timeout, scenario.spread)
    scenario.runs = {t.name: [] for t in scenario.targets}
    for i in range(rounds):
        line = []
        for target in scenario.targets:
            run = await run_load(target, scenario.upstream_pid, scenario.streams, scenario.body,
                                 scenario.expect_tokens, scenario.timeout, scenario.spread)
            scenario.runs[target.name].append(run)
            line.append(f"{target.name} {run.rate:,.0f} chunks/s ttft p50 "
                        f"{quantile(run.ttfts, 0.5) * 1e3:.1f} ms"
                        + (f" ERRORS {run.errors}" if run.errors else ""))
        log(f"  {scenario.title} round {i + 1}/{rounds}: " + " | ".join(line))
    return scenario


@dataclass
class SteadyRun:
    target: str
    ttfts: list[float]   # the newcomers'
    chunks: int          # content chunks relayed while the newcomers arrived
    cpu: dict[str, float]
    errors: int
    counted: int = 0     # prompt counting calls the upstream answered meanwhile


@dataclass
class Steady:
    """Newcomers arriving one by one while `background` streams already flow."""
    background: int
    newcomers: int
    interval: float
    delay: float
    upstream_pid: int
    targets: list[Target]
    timeout: float
    prompt_bytes: int = 0  # the newcomers' message (0: "Hello")
    upstream_port: int = 0  # the synthetic upstream's, to read how often it was asked to count
    runs: dict[str, list[SteadyRun]] = field(default_factory=dict)
    #: Where a target's background streams go, stream i to the (i mod n)-th (default: the
    #: target itself); e.g. directly to several engines, the one with a free slot last.
    backgrounds: dict[str, list[Target]] = field(default_factory=dict)
    #: A body of its own for the background streams and newcomers (default: synthetic).
    background_body: bytes | None = None
    newcomer_body: bytes | None = None
    newcomer_tokens: int = 2
    #: Whether every stream must bring exactly its tokens as content chunks (a real
    #: engine's chunk may carry no text: only status, [DONE] and some content count).
    exact_tokens: bool = True

    #: The background streams' length in tokens (0: long enough at `delay` per token).
    background_length: int = 0

    @property
    def background_tokens(self) -> int:
        if self.background_length:
            return self.background_length
        # ramp-up, the newcomers' window and a margin: still flowing after the last one
        return int((0.5 + self.newcomers * self.interval * 1.3 + 1.5) / self.delay)

    @property
    def prompt_label(self) -> str:
        return f"{self.prompt_bytes:,} B" if self.prompt_bytes else '"Hello"'

    def added_ttft(self, name: str, q: float) -> list[float]:
        return [quantile(a.ttfts, q) - quantile(b.ttfts, q)
                for a, b in zip(self.runs[name], self.runs["direct"])]

    def cpu_per_chunk(self, name: str, who: str) -> float:
        return median([r.cpu[who] / r.chunks * 1e6 for r in self.runs[name]
                       if r.chunks and who in r.cpu])


async def run_steady(s: Steady, target: Target, arrivals: list[float]) -> SteadyRun:
    """Background streams start evenly over 0.5 s; once every one has sent a token, a
    newcomer (2 tokens) arrives at each of `arrivals` (seconds from then); the relay's
    CPU and the chunks relayed are counted from the first arrival to the last newcomer's
    end."""
    ways = s.backgrounds.get(target.name, [target])
    background = [chat_request(t.port, s.background_body
                               or synthetic_body(s.background_tokens, s.delay)) for t in ways]
    newcomer = chat_request(target.port, s.newcomer_body
                            or synthetic_body(s.newcomer_tokens, s.delay, s.prompt_bytes))
    flows = [start_stream(ways[i % len(ways)].port, background[i % len(ways)], s.timeout,
                          i * 0.5 / s.background)
             for i in range(s.background)]
    clients = [c for c, _ in flows]
    deadline = time.monotonic() + s.timeout
    while not all(c.tokens for c in clients) and time.monotonic() < deadline:
        if any(t.done() for _, t in flows):
            break
        await asyncio.sleep(0.005)
    pids = {"relay": target.pid} if target.pid is not None else {}
    meter = CpuMeter(pids)
    tokens_before = sum(c.tokens for c in clients)
    counted_before = upstream_counted(s.upstream_port)
    started = time.perf_counter()
    joining = []
    for at in arrivals:
        pause = started + at - time.perf_counter()
        if pause > 0:
            await asyncio.sleep(pause)
        joining.append(start_stream(target.port, newcomer, s.timeout))
    await asyncio.gather(*(t for _, t in joining))
    chunks = sum(c.tokens for c in clients) - tokens_before + sum(c.tokens for c, _ in joining)
    counted = upstream_counted(s.upstream_port) - counted_before
    cpu = meter.spent()
    await asyncio.gather(*(t for _, t in flows))
    def ok(c: StreamClient, tokens: int) -> bool:
        return (c.status == 200 and c.saw_done and c.tokens > 0
                and (c.tokens == tokens or not s.exact_tokens))

    errors = sum(1 for c in clients if not ok(c, s.background_tokens))
    ttfts = []
    for c, _ in joining:
        if ok(c, s.newcomer_tokens):
            ttfts.append(c.t_first - c.t_send)
        else:
            errors += 1
    return SteadyRun(target.name, ttfts, chunks, cpu, errors, counted)


def upstream_counted(port: int) -> int:
    """Prompt counting calls the synthetic upstream has answered so far (0: unknown)."""
    if not port:
        return 0
    status, body = get_json(port, "/fake/stats")
    return body["counted"] if status == 200 else 0


async def run_steady_rounds(s: Steady, rounds: int, log: Callable[[str], None]) -> Steady:
    """Every target in turn per round, with the same (jittered) arrival times within a
    round, so that no target always meets the background streams at the same phase."""
    import random

    s.runs = {t.name: [] for t in s.targets}
    for i in range(rounds):
        rng = random.Random(i)
        arrivals = [k * s.interval + rng.uniform(0, s.interval / 2) for k in range(s.newcomers)]
        line = []
        for target in s.targets:
            run = await run_steady(s, target, arrivals)
            s.runs[target.name].append(run)
            line.append(f"{target.name} newcomer ttft p50 {quantile(run.ttfts, 0.5) * 1e3:.1f} ms"
                        + (f" ERRORS {run.errors}" if run.errors else ""))
        log(f"  steady state, newcomer prompt {s.prompt_label} round {i + 1}/{rounds}: "
            + " | ".join(line))
    return s


def synthetic_body(tokens: int, delay: float, prompt_bytes: int = 0, *,
                   content: str = "Hello") -> bytes:
    """A streamed chat request; its message is `content`, or `prompt_bytes` bytes of words."""
    if prompt_bytes > 0:
        words = "the relay counts this prompt before admission "
        content = (words * (prompt_bytes // len(words) + 1))[:prompt_bytes]
    return json.dumps({"model": "fake-model", "stream": True,
                       "messages": [{"role": "user", "content": content}],
                       "fake": {"n_tokens": tokens, "delay": delay}}).encode()


def llama_body(tokens: int) -> bytes:
    return json.dumps({"model": "tiny", "stream": True, "max_tokens": tokens, "ignore_eos": True,
                       "temperature": 0,
                       "messages": [{"role": "user", "content": "Hello"}]}).encode()
