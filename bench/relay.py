"""Relay benchmark: many concurrent streams through the port, and directly, A B A B.

    python bench/relay.py            # the full run (a few minutes)
    python bench/relay.py --quick    # a smoke run (well under a minute)

Every relay and upstream runs in a process of its own, so the CPU each spends can be read
from /proc/<pid>/stat; the load generator (this process) is a lean asyncio HTTP/1.1
client, the same code for every target.  Each round runs every target of a scenario one
after the other (port, direct, port, direct, ...), and the figures are medians over the
rounds of per-round ratios or differences: this machine is small and shared, so the
side-by-side figures mean more than the absolute ones.

1. Synthetic upstream (`tests/fake_upstream.py`, a fast llama-server look-alike) with
   `total_slots` >= the stream count, attached with `gguf-studio serve --upstream URL
   --max-output-tokens 0`:
   - realistic rate (one token per 20 ms per stream), 8 and 64 streams starting evenly
     over --spread seconds (and 64 at once): throughput port/direct, and the
     time-to-first-token the port adds (p50, p99; from request written to first content
     chunk; port minus direct within each round);
   - saturation (no delay): chunks/s through the port as a ratio to direct, and the CPU
     the port spends per relayed chunk, next to `bench/naive_relay.py` (a relay that
     parses and re-serialises every SSE line) measured the same way.
2. The real llama-server with a tiny random model (`tests/model_factory.py`), started
   here and attached with `--upstream`; direct = llama-server's own port.

Every scenario also measures `bench/tcp_proxy.py`, a byte-forwarding proxy: the price of
one more process hop on this machine at that moment, i.e. the floor for any relay.
`--variant NAME=FILE` adds a patched port (see bench/README.md).

Only loopback addresses are used; every process started here is ended on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PYTHON = sys.executable
CHAT = "/v1/chat/completions"

FAKE_CTX_PER_SLOT = 4096
TARGET_THROUGHPUT = 0.98
TARGET_TTFT_P50_MS = 2.0
TARGET_TTFT_P99_MS = 10.0


# --- processes ----------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if this benchmark dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Processes:
    """Every child process of the benchmark; `stop_all` ends them (TERM, then KILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str],
              env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        try:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        finally:
            log.close()
        self.children.append((name, proc))
        return proc

    def log_of(self, name: str) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop_all(self) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for _, proc in reversed(self.children):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.children.clear()

    def wait_for_line(self, name: str, proc: subprocess.Popen, pattern: str,
                      timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            match = regex.search(self.log_of(name))
            if match:
                return match
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{name} did not start (exit {proc.poll()}):\n"
                           f"{self.log_of(name)[-3000:]}")


def get_json(port: int, path: str, timeout: float = 2.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, None
    finally:
        conn.close()


def wait_until(check: Callable[[], bool], proc: subprocess.Popen, what: str, procs: Processes,
               name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if check():
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} (exit {proc.poll()}):\n{procs.log_of(name)[-3000:]}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of `pid` in seconds, from /proc/<pid>/stat (10 ms ticks, usually)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK



def port_env(config_dir: Path) -> dict[str, str]:
    """The environment of a `gguf-studio serve`: no saved settings, no GGUF_STUDIO_* leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env["XDG_CONFIG_HOME"] = str(config_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Target:
    name: str
    port: int
    pid: int | None  # the relay's process (None: direct to the upstream)


def start_port(procs: Processes, name: str, upstream: str, slots: int, config_dir: Path,
               patch: str | None = None) -> Target:
    """`gguf-studio serve --upstream URL` in its own process; ready once it reports `slots`."""
    serve = ["serve", "--upstream", upstream, "--host", HOST, "--port", "0",
             "--max-output-tokens", "0"]
    if patch:  # a file that patches the port, then runs backend.cli.main(sys.argv[1:])
        cmd = [PYTHON, patch, *serve]
    else:
        cmd = [PYTHON, "-m", "backend.cli", *serve]
    proc = procs.start(name, cmd, env=port_env(config_dir))
    port = int(procs.wait_for_line(name, proc, r"http://127\.0\.0\.1:(\d+)/v1").group(1))

    def ready() -> bool:
        status, body = get_json(port, "/health")
        return status == 200 and body["effective_parallel_slots"] == slots

    wait_until(ready, proc, f"{name} did not become ready with {slots} slots", procs, name)
    # Admission counts prompts only when it knows the engine's KV cache: measured with it on.
    if get_json(port, "/health")[1].get("kv") is None:
        raise RuntimeError(f"{name} knows no KV cache of its upstream: prompt counting is off")
    return Target(name, port, proc.pid)


# --- the load generator -------------------------------------------------------------------

CONTENT = b'"content":"'
EMPTY_CONTENT = b'"content":""'


class StreamClient(asyncio.Protocol):
    """One streamed request over its own connection: HTTP/1.1, chunked or not.

    Counts content chunks (SSE events carrying a non-empty `"content":"…"`), and notes
    when the request was written, when the first content chunk arrived and when the
    answer ended.  Whole events only: bytes after the last blank line wait for the next
    read.
    """

    def __init__(self, request: bytes, done: asyncio.Future) -> None:
        self.request = request
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.in_head = True
        self.status = 0
        self.chunked = False
        self.remaining: int | None = None  # Content-Length left, when not chunked
        self.raw = b""      # undecoded chunked bytes
        self.need = 0       # chunk data bytes still to come
        self.skip = 0       # CRLF bytes after a chunk still to skip
        self.tail = b""     # a partial event
        self.tokens = 0
        self.saw_done = False
        self.t_send = self.t_first = self.t_end = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.t_send = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.in_head:
            data = self.head + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self.head = data
                return
            head, data = data[:end], data[end + 4:]
            self.in_head = False
            lines = head.split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    self.chunked = True
                elif name == b"content-length":
                    self.remaining = int(value)
        if self.chunked:
            self._dechunk(data)
        else:
            self._body(data)
            if self.remaining is not None:
                self.remaining -= len(data)
                if self.remaining <= 0:
                    self._finish()

    def _dechunk(self, data: bytes) -> None:
        buf = self.raw + data if self.raw else data
        pos, end = 0, len(buf)
        parts = []
        last = False
        while pos < end:
            if self.need:
                take = min(self.need, end - pos)
                parts.append(buf[pos:pos + take])
                pos += take
                self.need -= take
                if not self.need:
                    self.skip = 2
            elif self.skip:
                take = min(self.skip, end - pos)
                pos += take
                self.skip -= take
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                pos = eol + 2
                if size == 0:
                    last = True
                    break
                self.need = size
        self.raw = buf[pos:] if pos < end else b""
        if parts:
            self._body(parts[0] if len(parts) == 1 else b"".join(parts))
        if last:
            self._finish()

    def _body(self, data: bytes) -> None:
        if self.tail:
            data = self.tail + data
        end = data.rfind(b"\n\n")
        if end < 0:
            self.tail = data
            return
        end += 2
        self.tail = data[end:]
        n = data.count(CONTENT, 0, end)
        if n:
            n -= data.count(EMPTY_CONTENT, 0, end)
            if n:
                if not self.tokens:
                    self.t_first = time.perf_counter()
                self.tokens += n
        if not self.saw_done and data.find(b"data: [DONE]", 0, end) >= 0:
            self.saw_done = True

    def _finish(self) -> None:
        if not self.done.done():
            self.t_end = time.perf_counter()
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.t_end = time.perf_counter()
            self.done.set_result(None)


@dataclass
class Run:
    target: str
    wall: float
    chunks: int
    ttfts: list[float]
    errors: int
    cpu: dict[str, float]  # seconds: relay, upstream, client

    @property
    def rate(self) -> float:
        return self.chunks / self.wall if self.wall > 0 else 0.0


def chat_request(port: int, body: bytes) -> bytes:
    return (f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def one_stream(port: int, request: bytes, timeout: float, start_after: float) -> StreamClient:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    client = StreamClient(request, done)
    if start_after > 0:
        await asyncio.sleep(start_after)
    try:
        await asyncio.wait_for(loop.create_connection(lambda: client, HOST, port), timeout)
        await asyncio.wait_for(done, timeout)
    except (OSError, asyncio.TimeoutError):
        if client.transport is not None:
            client.transport.close()
    return client


def start_stream(port: int, request: bytes, timeout: float,
                 start_after: float = 0.0) -> tuple[StreamClient, asyncio.Task]:
    """`one_stream`, but the client is returned at once, so its progress can be read."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    client = StreamClient(request, done)

    async def run() -> None:
        if start_after > 0:
            await asyncio.sleep(start_after)
        try:
            await asyncio.wait_for(loop.create_connection(lambda: client, HOST, port), timeout)
            await asyncio.wait_for(done, timeout)
        except (OSError, asyncio.TimeoutError):
            if client.transport is not None:
                client.transport.close()

    return client, loop.create_task(run())


async def run_load(target: Target, upstream_pid: int, streams: int, body: bytes,
                   expect_tokens: int | None, timeout: float, spread: float = 0.0) -> Run:
    """`streams` concurrent streams; stream i starts i*spread/streams seconds in."""
    request = chat_request(target.port, body)
    pids = {"upstream": upstream_pid}
    if target.pid is not None:
        pids["relay"] = target.pid
    before = {k: cpu_times(p) for k, p in pids.items()}
    client_before = time.process_time()
    started = time.perf_counter()
    clients = await asyncio.gather(*(one_stream(target.port, request, timeout, i * spread / streams)
                                     for i in range(streams)))
    wall = time.perf_counter() - started
    cpu = {}
    for k, p in pids.items():
        user, system = cpu_times(p)
        cpu[k] = user + system - sum(before[k])
        cpu[k + "_sys"] = system - before[k][1]
    cpu["client"] = time.process_time() - client_before
    errors = 0
    ttfts = []
    for c in clients:
        ok = c.status == 200 and c.saw_done and c.tokens > 0
        if expect_tokens is not None and c.tokens != expect_tokens:
            ok = False
        if ok:
            ttfts.append(c.t_first - c.t_send)
        else:
            errors += 1
    return Run(target.name, wall, sum(c.tokens for c in clients), ttfts, errors, cpu)


# --- statistics -----------------------------------------------------------------------------


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

    @property
    def background_tokens(self) -> int:
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
    background = chat_request(target.port, synthetic_body(s.background_tokens, s.delay))
    newcomer = chat_request(target.port, synthetic_body(2, s.delay, s.prompt_bytes))
    flows = [start_stream(target.port, background, s.timeout, i * 0.5 / s.background)
             for i in range(s.background)]
    clients = [c for c, _ in flows]
    deadline = time.monotonic() + s.timeout
    while not all(c.tokens for c in clients) and time.monotonic() < deadline:
        if any(t.done() for _, t in flows):
            break
        await asyncio.sleep(0.005)
    pids = {"relay": target.pid} if target.pid is not None else {}
    before = {k: cpu_times(p) for k, p in pids.items()}
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
    cpu = {}
    for k, p in pids.items():
        user, system = cpu_times(p)
        cpu[k] = user + system - sum(before[k])
        cpu[k + "_sys"] = system - before[k][1]
    await asyncio.gather(*(t for _, t in flows))
    errors = sum(1 for c in clients if not (c.status == 200 and c.saw_done
                                            and c.tokens == s.background_tokens))
    ttfts = []
    for c, _ in joining:
        if c.status == 200 and c.saw_done and c.tokens == 2:
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


# --- reports --------------------------------------------------------------------------------


def _range(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "n/a"
    return (fmt.format(median(values)) + " (" + fmt.format(min(values)) + "–"
            + fmt.format(max(values)) + ")")


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def latency_table(scenarios: list[Scenario], judged: str = "port") -> tuple[list[str], list[str]]:
    """One row per scenario and relay; returns the rows and the verdict lines."""
    rows = ["| scenario | arrivals | streams × tokens | relay | throughput ÷ direct "
            "| direct TTFT p50 / p99 ms | added TTFT p50 ms | added TTFT p99 ms "
            "| relay CPU µs/chunk (sys) |",
            "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for s in scenarios:
        direct = s.runs["direct"]
        d50 = median([quantile(r.ttfts, 0.5) for r in direct]) * 1e3
        d99 = median([quantile(r.ttfts, 0.99) for r in direct]) * 1e3
        arrivals = f"over {s.spread:g} s" if s.spread else "at once"
        for name in s.runs:
            if name == "direct":
                continue
            ratios = s.throughput_ratios(name)
            p50 = [x * 1e3 for x in s.added_ttft(name, 0.5)]
            p99 = [x * 1e3 for x in s.added_ttft(name, 0.99)]
            rows.append(f"| {s.title} | {arrivals} | {s.streams} × {s.tokens} | {name} "
                        f"| {_range(ratios)} | {d50:.1f} / {d99:.1f} | {_range(p50, '{:+.1f}')} "
                        f"| {_range(p99, '{:+.1f}')} | {s.cpu_per_chunk(name, 'relay'):.0f} "
                        f"({s.cpu_per_chunk(name, 'relay_sys'):.0f}) |")
            if name == judged and s.judged:
                checks = [(f"throughput {median(ratios):.3f} ≥ {TARGET_THROUGHPUT}",
                           median(ratios) >= TARGET_THROUGHPUT),
                          (f"added TTFT p50 {median(p50):+.2f} ms ≤ {TARGET_TTFT_P50_MS:g}",
                           median(p50) <= TARGET_TTFT_P50_MS),
                          (f"added TTFT p99 {median(p99):+.2f} ms ≤ {TARGET_TTFT_P99_MS:g}",
                           median(p99) <= TARGET_TTFT_P99_MS)]
                verdicts.append(f"- {s.title}, {s.streams} streams, arrivals {arrivals}: "
                                + "; ".join(f"{text} {_mark(ok)}" for text, ok in checks))
    return rows, verdicts


def saturation_table(s: Scenario) -> list[str]:
    rows = [f"Saturation: {s.streams} streams × {s.tokens} tokens at once, no delay, "
            f"{len(s.runs['direct'])} rounds (CPU per relayed chunk: utime+stime of each process)",
            "",
            "| relay | chunks/s | ÷ direct | relay CPU µs/chunk (sys) "
            "| upstream CPU µs/chunk | client CPU µs/chunk |",
            "|---|---|---|---|---|---|"]
    for name in s.runs:
        rates = [r.rate for r in s.runs[name]]
        ratio = "1" if name == "direct" else _range(s.throughput_ratios(name))
        relay_cpu = "—" if name == "direct" else (f"{s.cpu_per_chunk(name, 'relay'):.1f} "
                                                  f"({s.cpu_per_chunk(name, 'relay_sys'):.1f})")
        rows.append(f"| {name} | {median(rates):,.0f} | {ratio} | {relay_cpu} "
                    f"| {s.cpu_per_chunk(name, 'upstream'):.1f} "
                    f"| {s.cpu_per_chunk(name, 'client'):.1f} |")
    return rows


def steady_table(s: Steady) -> list[str]:
    direct = s.runs["direct"]
    d50 = median([quantile(r.ttfts, 0.5) for r in direct]) * 1e3
    d99 = median([quantile(r.ttfts, 0.99) for r in direct]) * 1e3
    rows = [f"Steady state: a newcomer (prompt {s.prompt_label}) arrives every {s.interval * 1e3:g}–"
            f"{s.interval * 1.5e3:g} ms ({s.newcomers} per round, 2 tokens each) while "
            f"{s.background} streams flow at one token per {s.delay * 1e3:g} ms; "
            f"{len(direct)} rounds; direct newcomer TTFT p50 / p99 {d50:.1f} / {d99:.1f} ms; "
            "CPU per paced chunk = relay CPU from the first arrival to the last newcomer's "
            "end ÷ content chunks relayed meanwhile",
            "",
            "| relay | newcomer added TTFT p50 ms | newcomer added TTFT p99 ms "
            "| relay CPU µs per paced chunk (sys) | chunks per round "
            "| upstream counting calls per newcomer |",
            "|---|---|---|---|---|---|"]
    for name, runs in s.runs.items():
        if name == "direct":
            continue
        p50 = [x * 1e3 for x in s.added_ttft(name, 0.5)]
        p99 = [x * 1e3 for x in s.added_ttft(name, 0.99)]
        rows.append(f"| {name} | {_range(p50, '{:+.1f}')} | {_range(p99, '{:+.1f}')} "
                    f"| {s.cpu_per_chunk(name, 'relay'):.0f} "
                    f"({s.cpu_per_chunk(name, 'relay_sys'):.0f}) "
                    f"| {median([r.chunks for r in runs]):,.0f} "
                    f"| {median([r.counted / s.newcomers for r in runs]):.2f} |")
    return rows


# --- the benchmark ------------------------------------------------------------------------------


def synthetic_body(tokens: int, delay: float, prompt_bytes: int = 0) -> bytes:
    """A streamed chat request; its message is "Hello", or `prompt_bytes` bytes of words."""
    content = "Hello"
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


def start_helper(procs: Processes, name: str, script: str, upstream: str, banner: str) -> Target:
    proc = procs.start(name, [PYTHON, str(REPO / "bench" / script), "--upstream", upstream,
                              "--port", "0"])
    port = int(procs.wait_for_line(name, proc, banner + r" on http://127\.0\.0\.1:(\d+)").group(1))
    return Target(name, port, proc.pid)


def stop_children(procs: Processes) -> None:
    for _, proc in list(procs.children):
        procs.stop(proc)
    procs.children.clear()


async def synthetic(args: argparse.Namespace, procs: Processes, work: Path,
                    log: Callable[[str], None]) -> tuple[list[Scenario], Scenario | None,
                                                         list[Steady]]:
    slots = max([*args.streams, args.sat_streams, args.steady_background + 1])
    # A pool of 4,096 tokens per slot, reported as the per-slot context (llama-server
    # with a unified cache does so): every stream fits at once with the default output
    # budget, so admission counts every prompt and never queues.
    fake = procs.start("fake-upstream", [PYTHON, "-m", "tests.fake_upstream", "--host", HOST,
                                         "--port", "0", "--slots", str(slots),
                                         "--n-ctx", str(slots * FAKE_CTX_PER_SLOT)])
    fake_port = int(procs.wait_for_line("fake-upstream", fake,
                                        r"fake llama-server on http://127\.0\.0\.1:(\d+)").group(1))
    upstream = f"http://{HOST}:{fake_port}"
    direct = Target("direct", fake_port, None)
    ports = [start_port(procs, "port", upstream, slots, work / "config")]
    for name, patch in args.variant:
        ports.append(start_port(procs, name, upstream, slots, work / "config", patch))
    floor = start_helper(procs, "tcp-proxy", "tcp_proxy.py", upstream, "tcp proxy")
    log(f"synthetic upstream pid {fake.pid} on {upstream} ({slots} slots); "
        + ", ".join(f"{t.name} pid {t.pid} on :{t.port}" for t in [*ports, floor]))

    realistic = []
    title = f"synthetic, {args.delay * 1e3:g} ms/token"
    timeout = 60 + args.tokens * args.delay * 4
    for streams in args.streams:
        for spread in ([args.spread, 0.0] if args.burst and args.spread else [args.spread]):
            if streams <= 8 and spread == 0.0 and args.spread:
                continue  # a burst of a few streams says nothing new
            s = Scenario(title, streams, args.tokens, synthetic_body(args.tokens, args.delay),
                         fake.pid, [*ports, direct, floor], args.tokens, timeout, spread,
                         judged=spread == args.spread)
            realistic.append(await run_scenario(s, args.rounds, log))

    saturation = None
    if args.sat_tokens > 0:
        naive = start_helper(procs, "naive-relay", "naive_relay.py", upstream, "naive relay")
        s = Scenario("saturation", args.sat_streams, args.sat_tokens,
                     synthetic_body(args.sat_tokens, 0.0), fake.pid, [*ports, direct, naive, floor],
                     args.sat_tokens, timeout=180)
        saturation = await run_scenario(s, args.sat_rounds, log)

    steady = []
    if args.steady_newcomers > 0:
        for size in args.steady_prompt_bytes:
            s = Steady(args.steady_background, args.steady_newcomers, args.steady_interval,
                       args.delay, fake.pid, [*ports, direct, floor], timeout, size, fake_port)
            steady.append(await run_steady_rounds(s, args.steady_rounds, log))
    stop_children(procs)
    return realistic, saturation, steady


async def real_llama(args: argparse.Namespace, procs: Processes, work: Path,
                     log: Callable[[str], None]) -> Scenario | None:
    from backend.engine import Engine
    from tests.model_factory import write_tiny_model

    engine = Engine()
    chosen = engine.resolve().chosen
    if chosen is None:
        log("no llama-server binary found (run scripts/setup): real llama-server part skipped")
        return None
    vocab = (await engine.source_tree_async()) / "models" / "ggml-vocab-llama-spm.gguf"
    model = write_tiny_model(work / "tiny.gguf", vocab)
    port = free_port()
    cmd = [str(chosen.path), "--model", str(model), "--alias", "tiny", "--host", HOST,
           "--port", str(port), "--parallel", str(args.llama_streams),
           "--ctx-size", str(args.llama_streams * max(1024, args.llama_tokens * 2)),
           "--n-gpu-layers", "0", "--metrics", "--no-webui", "--jinja"]
    if args.llama_threads:
        cmd += ["--threads", str(args.llama_threads)]
    server = procs.start("llama-server", cmd)

    def healthy() -> bool:
        return get_json(port, "/health")[0] == 200

    wait_until(healthy, server, "llama-server did not become healthy", procs, "llama-server", 120)
    slots = get_json(port, "/props")[1]["total_slots"]
    upstream = f"http://{HOST}:{port}"
    relays = [start_port(procs, "port", upstream, slots, work / "config")]
    for name, patch in args.variant:
        relays.append(start_port(procs, name, upstream, slots, work / "config", patch))
    floor = start_helper(procs, "tcp-proxy", "tcp_proxy.py", upstream, "tcp proxy")
    log(f"llama-server pid {server.pid} on :{port} ({slots} slots); "
        + ", ".join(f"{t.name} pid {t.pid} on :{t.port}" for t in [*relays, floor]))
    # Not judged against the targets: the tiny model streams ~10x faster than the
    # realistic rate, so this is closer to saturation; it shows the real engine's framing.
    title = "llama-server, tiny model" + (f", {args.llama_threads} thread"
                                          f"{'s' if args.llama_threads > 1 else ''}"
                                          if args.llama_threads else "")
    s = Scenario(title, args.llama_streams, args.llama_tokens,
                 llama_body(args.llama_tokens), server.pid,
                 [*relays, Target("direct", port, None), floor], None, timeout=120, judged=False)
    result = await run_scenario(s, args.rounds, log)
    stop_children(procs)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Relay benchmark: the port vs direct, A B A B.")
    p.add_argument("--quick", action="store_true", help="a smoke run: small loads, one round")
    p.add_argument("--rounds", type=int,
                   help="rounds of the realistic and llama-server scenarios (5; quick 1)")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")],
                   help="realistic-rate stream counts, comma separated (8,64; quick 8)")
    p.add_argument("--tokens", type=int, help="tokens per realistic stream (50; quick 10)")
    p.add_argument("--delay", type=float, default=0.02, help="seconds per token (0.02)")
    p.add_argument("--spread", type=float, default=0.5,
                   help="realistic streams start evenly over this many seconds (0.5); "
                        "0 = all at once")
    p.add_argument("--no-burst", dest="burst", action="store_false",
                   help="skip the extra all-at-once run of the larger stream counts")
    p.add_argument("--sat-streams", type=int, help="saturation streams (64; quick 16)")
    p.add_argument("--sat-tokens", type=int,
                   help="tokens per saturation stream, 0 = skip (500; quick 100)")
    p.add_argument("--sat-rounds", type=int, help="saturation rounds (3; quick 1)")
    p.add_argument("--llama-streams", type=int,
                   help="real llama-server streams = slots (4; quick 2)")
    p.add_argument("--llama-tokens", type=int,
                   help="tokens per llama-server stream, 0 = skip (200; quick 32)")
    p.add_argument("--llama-threads", type=int, default=1,
                   help="llama-server --threads, 0 = its default (1: on a shared 2-core "
                        "machine its spinning worker threads stall for 100s of ms when one "
                        "is descheduled)")
    p.add_argument("--steady-newcomers", type=int,
                   help="steady state: newcomers per round, 0 = skip (40; quick 10)")
    p.add_argument("--steady-background", type=int, default=63,
                   help="steady state: streams already flowing (63)")
    p.add_argument("--steady-interval", type=float, default=0.1,
                   help="steady state: a newcomer every this many seconds, plus up to half "
                        "as much jitter (0.1)")
    p.add_argument("--steady-rounds", type=int, help="steady state rounds (3; quick 1)")
    p.add_argument("--steady-prompt-bytes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[0, 16000],
                   help="steady state: the newcomers' prompt sizes in bytes, one scenario "
                        "each, comma separated; 0 = \"Hello\", which the port's byte bound "
                        "admits without counting; 16000 is counted by the upstream (0,16000)")
    p.add_argument("--aiohttp", action="store_true",
                   help="also measure the port with aiohttp's client on the upstream leg "
                        "(port-aiohttp, bench/variants/aiohttp_port.py)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                   help="also measure a patched port: FILE patches, then calls "
                        "backend.cli.main(sys.argv[1:]) (repeatable)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the processes' logs and print where")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {"rounds": (5, 1), "streams": ([8, 64], [8]), "tokens": (50, 10),
                "sat_streams": (64, 16), "sat_tokens": (500, 100), "sat_rounds": (3, 1),
                "llama_streams": (4, 2), "llama_tokens": (200, 32),
                "steady_newcomers": (40, 10), "steady_rounds": (3, 1)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    variants = []
    for spec in args.variant:
        name, _, path = spec.partition("=")
        if not name or not path or name in {"port", "direct", "naive-relay", "tcp-proxy"}:
            p.error("--variant takes NAME=FILE, NAME not one of port, direct, naive-relay, "
                    "tcp-proxy")
        variants.append((name, str(Path(path).resolve())))
    if args.aiohttp:
        variants.append(("port-aiohttp", str(REPO / "bench" / "variants" / "aiohttp_port.py")))
    args.variant = variants
    return args


def machine_note() -> str:
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return f"{os.cpu_count()} CPUs, load average at the end {load}"


async def main_async(args: argparse.Namespace, procs: Processes, work: Path) -> int:
    started = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    realistic, saturation, steady = await synthetic(args, procs, work, log)
    llama = await real_llama(args, procs, work, log) if args.llama_tokens > 0 else None

    out = [f"relay benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {machine_note()}; "
           f"{args.rounds} rounds{' (quick)' if args.quick else ''}, "
           f"{time.monotonic() - started:.0f} s",
           "",
           f"Realistic rate: one token per {args.delay * 1e3:g} ms per stream (synthetic upstream)"
           + (", and the real llama-server with a tiny model (as fast as it goes)" if llama else "")
           + "; medians over rounds of per-round figures, (min–max) across rounds",
           ""]
    rows, verdicts = latency_table([*realistic, *([llama] if llama else [])])
    out += rows
    if saturation is not None:
        out += ["", *saturation_table(saturation)]
    for s in steady:
        out += ["", *steady_table(s)]
    errors = sum(s.errors() for s in [*realistic, saturation, llama] if s is not None)
    for s in steady:
        errors += sum(r.errors for runs in s.runs.values() for r in runs)
    out += ["", f"Targets for the port at the realistic rate with arrivals spread over "
                f"{args.spread:g} s (throughput ≥ {TARGET_THROUGHPUT}× direct, "
                f"added TTFT p50 ≤ {TARGET_TTFT_P50_MS:g} ms, p99 ≤ {TARGET_TTFT_P99_MS:g} ms; "
                "TTFT from request "
                "written to first content chunk; added = port − direct within each round, "
                "median over rounds):",
            *(verdicts or ["- none judged in this run"]), f"stream errors: {errors}"]
    print("\n".join(out), flush=True)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gguf-studio-bench-"))
    (work / "config").mkdir()
    procs = Processes(work)

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        return asyncio.run(main_async(args, procs, work))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        if args.keep_logs:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
