"""Pool benchmark: the port in front of N engines, and directly, side by side in one run.

    python bench/pool.py            # the full run (about 30 minutes)
    python bench/pool.py --quick    # a smoke run (about 4 minutes)
    python bench/pool.py --skip-pool --llama-tokens 0 --clients "" \
        --against before=/tmp/before-52cece1          # the burst alone, beside 52cece1's port

1. Pool: N = 1, 2, 4 synthetic engines (`tests/fake_upstream.py --enforce-slots`: 4
   slots each, a request beyond them waits as on llama-server; one token per 20 ms)
   behind one `gguf-studio serve --upstream A --upstream B ...` (attached as users
   attach them: the KV layout unstated):
   - throughput: 4N streams through the port, against 4 on each engine directly and 4
     on one engine alone (target: the port's rate >= 0.95 x N x one engine's);
   - newcomer: 4N-1 streams flow and newcomers arrive one by one, each taking the one
     free slot: the time to first token the port adds over going directly to the
     engine with the free slot (targets: p50 <= 2 ms, p99 <= 10 ms);
   - routing CPU per request: the admission decision in this process (µs, for N
     engines), and the port process's whole CPU per short request (from /proc).
2. Closed loop: C agents (64 and 8), each on its own kept-alive connection, sending its
   next request the moment the last one's answer ended (as coding agents do), 256 tokens
   at 20 ms per token, to one synthetic engine of C slots: the time to first token the
   port adds over direct (p50, p99; target 2 ms), next to the byte-forwarding tcp-proxy.
   `--variant NAME=FILE` adds a patched port, or another checkout's
   (`bench/variants/checkout_port.py`): before and after in one run;
   `bench/variants/traced_port.py` (with `--keep-logs`) says which part of the added
   time is the port's own work and which the engine's.
3. Burst: N agents (64 and 8) in lockstep, each on its own kept-alive connection: every
   agent's request is written in the same loop turn, and the next burst the moment the
   last answer of this one ended (256 tokens at 20 ms per token, one synthetic engine of
   N slots).  What the port's serial work per request costs the first token when requests
   arrive together: the added TTFT (p50, p99, over direct; aim: at most 100 µs of serial
   work per request, N x 0.1 ms at p50), and the port's CPU from a burst's first write to
   its last first token, per request.  `--against NAME=CHECKOUT` measures another
   checkout's port beside this one (a `git archive` of it), here and in the closed loop.
4. Real engines: two llama-servers with the tiny test model (`tests/model_factory.py`),
   started as users start them (`-np 4`, the default cache; but `--threads 1`: on this
   shared 2-core machine spinning worker threads stall whenever one is descheduled),
   attached as users attach them (`serve --upstream A [--upstream B]`): the throughput
   of 4N streams through the port over N = 1, 2 of them, against 4 on each directly and
   4 on one alone (for N = 1, "direct" and "one engine" are the same: their ratio is
   the run's noise); and the closed loop of 4 agents over one.  Not judged: the tiny
   model streams far faster than the realistic rate, so one engine takes a whole core
   and two take both of this machine's (the port and the client then compete with
   them, directly or not).  SmolLM2 (`tests/wheel_models.py`) is not used: the managed
   engine dies on it in llama.cpp's AMX path on this machine unless started with
   `--no-repack`, which is not how users start it.

Every round runs every target of a scenario one after the other, and the figures are
medians over rounds of per-round ratios or differences (see bench/README.md).  Only
loopback addresses are used; every process started here is ended on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.load_generator import (Run, chat_request, one_stream, run_burst,  # noqa: E402
                                  run_closed_loop)
from bench.pool_results import PoolResult, RealResult  # noqa: E402
from bench.processes import (HOST, CpuMeter, Processes, Target, free_port,  # noqa: E402
                             get_json, run_bench, start_fake, start_helper, start_port,
                             stop_children, wait_until)
from bench.report import (burst_table, closed_loop_table, machine_note,  # noqa: E402
                          pool_newcomer_table,
                          pool_throughput_table, real_engine_tables, routing_table)
from bench.scenarios import (Scenario, Steady, llama_body, median,  # noqa: E402
                             run_steady_rounds, synthetic_body)

#: Slots of each synthetic engine of the pool.
SLOTS = 4
#: The context each synthetic engine reports for a slot: an attached port takes it as one
#: pool shared by the slots, in which 4 requests of the default output budget fit.
POOL_CTX = SLOTS * 4096
LOG = Callable[[str], None]
#: Runs another checkout's port (`--against`).
CHECKOUT_PORT = REPO / "bench" / "variants" / "checkout_port.py"


# --- the pool ------------------------------------------------------------------------------


async def pool_part(args: argparse.Namespace, procs: Processes, work: Path,
                    log: LOG) -> list[PoolResult]:
    results = []
    for n in args.engines:
        engines = [start_fake(procs, f"engine{n}-{i}", SLOTS, POOL_CTX, enforce_slots=True)
                   for i in range(n)]
        direct = [target for target, _ in engines]
        pids = [proc.pid for _, proc in engines]
        urls = [f"http://{HOST}:{t.port}" for t in direct]
        port = start_port(procs, "port", urls, SLOTS * n, work / "config")
        log(f"pool of {n}: engines on " + ", ".join(f":{t.port}" for t in direct)
            + f"; port pid {port.pid} on :{port.port}")
        result = PoolResult(n)
        body = synthetic_body(args.tokens, args.delay)
        timeout = 60 + args.tokens * args.delay * 4
        # One engine alone, every engine directly (4 streams each), and the port (4N).
        plans = {"one engine": [direct[0].port] * SLOTS,
                 "direct": [t.port for t in direct for _ in range(SLOTS)],
                 "port": [port.port] * (SLOTS * n)}
        result.throughput, result.waited = await throughput_rounds(
            plans, port.pid, pids, body, args.tokens, timeout, args.rounds,
            lambda text: log(f"  pool of {n}, {text}"), fakes=direct)

        # Newcomers: the engine with the free slot is engines[0] (direct: it gets 3
        # background streams, every other one 4; the port must find it by itself).
        first = Target("direct", direct[0].port, None)
        steady = Steady(SLOTS * n - 1, args.newcomers, args.interval, args.delay, pids[0],
                        [port, first], timeout,
                        backgrounds={"direct": [*direct[1:], direct[0]]})
        result.steady = await run_steady_rounds(steady, args.steady_rounds,
                                                lambda text: log(f"  pool of {n}: {text.strip()}"))

        # The port's whole CPU per short request: 4N agents, one-token answers, no delay.
        short = synthetic_body(1, 0.0)
        for _ in range(args.rounds):
            run = await run_closed_loop(port, pids, SLOTS * n, args.short_requests, short, 1,
                                        timeout=30)
            done = SLOTS * n * args.short_requests - run.errors
            if done:
                result.port_cpu_per_request.append(run.cpu["relay"] / done)
        log(f"  pool of {n}: port CPU per short request "
            f"{median(result.port_cpu_per_request) * 1e6:.0f} µs")
        results.append(result)
        stop_children(procs)
    return results


async def throughput_rounds(plans: dict[str, list[int]], port_pid: int | None,
                            engine_pids: list[int], body: bytes, expect_tokens: int | None,
                            timeout: float, rounds: int, log: LOG,
                            fakes: list[Target] | None = None
                            ) -> tuple[dict[str, list[Run]], dict[str, int]]:
    """`rounds` rounds of every plan in turn (a plan: one stream to each of its ports,
    all at once); the runs per plan, and for synthetic engines (`fakes`) the requests
    that waited there for a slot, per plan."""
    runs: dict[str, list[Run]] = {name: [] for name in plans}
    waited = {name: 0 for name in plans}
    for i in range(rounds):
        line = []
        for name, ports in plans.items():
            before = engines_waited(fakes) if fakes else 0
            run = await run_streams(name, port_pid if name == "port" else None, engine_pids,
                                    ports, body, expect_tokens, timeout)
            waited[name] += (engines_waited(fakes) - before) if fakes else 0
            runs[name].append(run)
            line.append(f"{name} {run.rate:,.0f} chunks/s"
                        + (f" ERRORS {run.errors}" if run.errors else ""))
        log(f"throughput round {i + 1}/{rounds}: " + " | ".join(line))
    return runs, waited


def engines_waited(engines: list[Target]) -> int:
    """Requests that waited for a slot at the synthetic engines so far."""
    total = 0
    for engine in engines:
        status, body = get_json(engine.port, "/fake/stats")
        total += body["waited"] if status == 200 else 0
    return total


async def run_streams(name: str, relay_pid: int | None, upstream_pids: list[int],
                      ports: list[int], body: bytes, expect_tokens: int | None,
                      timeout: float) -> Run:
    """One stream to each of `ports`, all at once; the rate over the whole run."""
    pids = {f"upstream{i}" if i else "upstream": pid for i, pid in enumerate(upstream_pids)}
    if relay_pid is not None:
        pids["relay"] = relay_pid
    meter = CpuMeter(pids)
    started = time.perf_counter()
    clients = await asyncio.gather(*(one_stream(p, chat_request(p, body), timeout, 0.0)
                                     for p in ports))
    wall = time.perf_counter() - started
    cpu = meter.spent()
    errors, ttfts = 0, []
    for c in clients:
        if c.status == 200 and c.saw_done and c.tokens > 0 and (
                expect_tokens is None or c.tokens == expect_tokens):
            ttfts.append(c.t_first - c.t_send)
        else:
            errors += 1
    return Run(name, wall, sum(c.tokens for c in clients), ttfts, errors, cpu)


def routing_cpu(engines: int, iterations: int) -> float:
    """Seconds of CPU one admission decision takes in this process: a request that finds
    the one free slot among `engines` engines of 4 busy slots, and its release."""
    from backend.llama.kv_capacity import KvCapacity, TokenNeed
    from backend.llama.load import Serving
    from backend.admission.admission_registry import AdmissionRegistry

    registry = AdmissionRegistry()
    for i in range(engines):
        registry.activate(Serving(f"http://127.0.0.1:{9000 + i}", SLOTS,
                                  kv=KvCapacity.shared(POOL_CTX)), model="m", engine=f"e{i}")
    line = registry.line("m")
    need = TokenNeed(40, 2048)
    busy = [line.request(need) for _ in range(SLOTS * engines - 1)]
    started = time.process_time()
    for _ in range(iterations):
        line.request(need).release()
    spent = time.process_time() - started
    for ticket in busy:
        ticket.release()
    return spent / iterations


# --- the closed loop -----------------------------------------------------------------------


async def closed_part(args: argparse.Namespace, procs: Processes, work: Path,
                      log: LOG) -> list[Scenario]:
    results = []
    for clients in args.clients:
        requests = args.closed_requests if clients >= 32 else args.closed_requests_few
        fake, proc = start_fake(procs, f"closed-{clients}", clients, clients * 4096,
                                enforce_slots=True)
        upstream = f"http://{HOST}:{fake.port}"
        ports = start_ports(args, procs, upstream, clients, work)
        floor = start_helper(procs, "tcp-proxy", "tcp_proxy.py", upstream, "tcp proxy")
        log(f"closed loop, {clients} agents: engine pid {proc.pid} on {upstream}; "
            + ", ".join(f"{t.name} pid {t.pid} on :{t.port}" for t in [*ports, floor]))
        targets = [*ports, Target("direct", fake.port, None), floor]
        body = synthetic_body(args.closed_tokens, args.delay)
        s = Scenario(f"closed loop, {args.delay * 1e3:g} ms/token", clients,
                     args.closed_tokens, body, proc.pid, targets, args.closed_tokens,
                     timeout=60 + args.closed_tokens * args.delay * 4,
                     spread=args.closed_spread, requests=requests)
        await closed_rounds(s, args.closed_rounds, log)
        results.append(s)
        stop_children(procs)
    return results


async def closed_rounds(s: Scenario, rounds: int, log: LOG) -> Scenario:
    """Every target in turn per round, `s.streams` agents of `s.requests` requests each.
    Each round starts with the next target: the first of a round runs slower (measured:
    whichever target went first, its p50 was several ms worse in round 1), so no target
    may always be first."""
    s.runs = {t.name: [] for t in s.targets}
    for i in range(rounds):
        line = []
        turn = i % len(s.targets)
        for target in s.targets[turn:] + s.targets[:turn]:
            run = await run_closed_loop(target, [s.upstream_pid], s.streams, s.requests,
                                        s.body, s.expect_tokens, s.timeout, s.spread)
            s.runs[target.name].append(run)
            line.append(f"{target.name} ttft p50 {_q(run.ttfts, 0.5):.1f} p99 "
                        f"{_q(run.ttfts, 0.99):.1f} ms" + (f" ERRORS {run.errors}" if run.errors else ""))
        log(f"  {s.title}, {s.streams} agents round {i + 1}/{rounds}: " + " | ".join(line))
    return s


def start_ports(args: argparse.Namespace, procs: Processes, upstream: str, slots: int,
                work: Path) -> list[Target]:
    """This checkout's port, then each `--variant`'s and each `--against` checkout's."""
    ports = [start_port(procs, "port", upstream, slots, work / "config")]
    for name, patch in args.variant:
        ports.append(start_port(procs, name, upstream, slots, work / "config", patch))
    for name, checkout in args.against:
        ports.append(start_port(procs, name, upstream, slots, work / "config", str(CHECKOUT_PORT),
                                env={"BENCH_CHECKOUT": checkout}))
    return ports


# --- the burst -----------------------------------------------------------------------------


async def burst_part(args: argparse.Namespace, procs: Processes, work: Path,
                     log: LOG) -> list[Scenario]:
    results = []
    for agents in args.burst:
        fake, proc = start_fake(procs, f"burst-{agents}", agents, agents * 4096,
                                enforce_slots=True)
        upstream = f"http://{HOST}:{fake.port}"
        ports = start_ports(args, procs, upstream, agents, work)
        floor = ([start_helper(procs, "tcp-proxy", "tcp_proxy.py", upstream, "tcp proxy")]
                 if args.burst_floor else [])
        log(f"burst, {agents} agents: engine pid {proc.pid} on {upstream}; "
            + ", ".join(f"{t.name} pid {t.pid} on :{t.port}" for t in [*ports, *floor]))
        s = Scenario(f"burst, {args.delay * 1e3:g} ms/token"
                     + (", each agent its own conversation" if args.burst_distinct else ""),
                     agents, args.closed_tokens,
                     synthetic_body(args.closed_tokens, args.delay), proc.pid,
                     [*ports, Target("direct", fake.port, None), *floor], args.closed_tokens,
                     timeout=60 + args.closed_tokens * args.delay * 4, requests=args.bursts)
        await burst_rounds(s, args.burst_rounds, log, burst_bodies(
            agents, args.closed_tokens, args.delay, args.burst_distinct))
        results.append(s)
        stop_children(procs)
    return results


def burst_bodies(agents: int, tokens: int, delay: float,
                 distinct: bool) -> bytes | list[bytes]:
    """Every agent the same conversation (the port then sees them as one session, named
    by the conversation's start), or each its own."""
    if not distinct:
        return synthetic_body(tokens, delay)
    return [synthetic_body(tokens, delay, content=f"Hello from agent {i}")
            for i in range(agents)]


async def burst_rounds(s: Scenario, rounds: int, log: LOG,
                       bodies: bytes | list[bytes]) -> Scenario:
    """Every target in turn per round, `s.requests` measured bursts of `s.streams` agents
    each (`bodies`: see `burst_bodies`); each round starts with the next target (see
    `closed_rounds`)."""
    s.runs = {t.name: [] for t in s.targets}
    for i in range(rounds):
        line = []
        turn = i % len(s.targets)
        for target in s.targets[turn:] + s.targets[:turn]:
            run = await run_burst(target, [s.upstream_pid], s.streams, s.requests,
                                  bodies, s.expect_tokens, s.timeout)
            s.runs[target.name].append(run)
            line.append(f"{target.name} ttft p50 {_q(run.ttfts, 0.5):.1f} p99 "
                        f"{_q(run.ttfts, 0.99):.1f} ms" + (f" ERRORS {run.errors}" if run.errors else ""))
        log(f"  {s.title}, {s.streams} agents round {i + 1}/{rounds} "
            f"(load {os.getloadavg()[0]:.1f}): " + " | ".join(line))
    return s


def _q(values: list[float], q: float) -> float:
    from bench.scenarios import quantile
    return quantile(values, q) * 1e3


# --- the real engine -----------------------------------------------------------------------


async def real_part(args: argparse.Namespace, procs: Processes, work: Path,
                    log: LOG) -> RealResult | None:
    from backend.llama.engine import Engine
    from tests.model_factory import write_tiny_model

    engine = Engine()
    chosen = engine.resolve().chosen
    if chosen is None:
        log("no llama-server binary found (run scripts/setup): the real engine part is skipped")
        return None
    vocab = (await engine.source_tree_async()) / "models" / "ggml-vocab-llama-spm.gguf"
    model = write_tiny_model(work / "tiny.gguf", vocab)
    servers: list[tuple[Target, subprocess.Popen]] = []
    for i in range(max(args.llama_engines)):
        port = free_port()
        # As users start it (-np 4, the default cache and context), on one thread.
        server = procs.start(f"llama-server{i}", [
            str(chosen.path), "--model", str(model), "--host", HOST, "--port", str(port),
            "-np", str(SLOTS), "--threads", "1"])
        wait_until(lambda: get_json(port, "/health")[0] == 200, server,
                   "llama-server did not become healthy", procs, f"llama-server{i}", 120)
        servers.append((Target(f"llama-server{i}", port, None), server))
    direct = [t for t, _ in servers]
    pids = [p.pid for _, p in servers]
    props = get_json(direct[0].port, "/props")[1]
    title = (f"llama-server -np {props['total_slots']}, tiny model, "
             f"{props['default_generation_settings']['n_ctx']} tokens per slot")
    log(f"{title}: " + ", ".join(f"pid {p.pid} on :{t.port}" for t, p in servers))

    # A real engine's chunk may carry no text: the content chunks are not checked.
    body = llama_body(args.llama_tokens)
    pool, closed = [], None
    for n in args.llama_engines:
        port = start_port(procs, f"port{n}", [f"http://{HOST}:{t.port}" for t in direct[:n]],
                          SLOTS * n, work / "config")
        plans = {"one engine": [direct[0].port] * SLOTS,
                 "direct": [t.port for t in direct[:n] for _ in range(SLOTS)],
                 "port": [port.port] * (SLOTS * n)}
        result = PoolResult(n)
        await run_streams("warm-up", None, pids, plans["direct"], body, None, 120)
        result.throughput, result.waited = await throughput_rounds(
            plans, port.pid, pids[:n], body, None, 120, args.rounds,
            lambda text: log(f"  real engines, pool of {n}, {text}"))
        pool.append(result)
        if n == 1:
            closed = Scenario(f"{title}, closed loop", SLOTS, args.closed_tokens,
                              llama_body(args.closed_tokens), pids[0],
                              [Target("port", port.port, port.pid),
                               Target("direct", direct[0].port, None)], None,
                              timeout=120, spread=0.0, requests=args.closed_requests_few)
            await closed_rounds(closed, args.rounds, log)
    stop_children(procs)
    return RealResult(title, pool, closed)


# --- the run -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pool benchmark: the port over N engines vs direct.")
    p.add_argument("--quick", action="store_true", help="a smoke run: small loads, one round")
    p.add_argument("--engines", type=lambda s: [int(x) for x in s.split(",")],
                   help="pool sizes, comma separated (1,2,4; quick 1,2)")
    p.add_argument("--rounds", type=int, help="rounds of throughput and real-engine runs (5; quick 1)")
    p.add_argument("--tokens", type=int, help="tokens per throughput stream (100; quick 25)")
    p.add_argument("--delay", type=float, default=0.02, help="seconds per token (0.02)")
    p.add_argument("--newcomers", type=int, help="newcomers per round (40; quick 10)")
    p.add_argument("--interval", type=float, default=0.1,
                   help="a newcomer every this many seconds plus up to half as much (0.1)")
    p.add_argument("--steady-rounds", type=int, help="newcomer rounds (3; quick 1)")
    p.add_argument("--short-requests", type=int,
                   help="one-token requests per agent for the port's CPU per request (50; quick 10)")
    p.add_argument("--routing-iterations", type=int, default=20000,
                   help="admission decisions timed per pool size (20000)")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="closed-loop agent counts, comma separated; empty skips (64,8; quick 64)")
    p.add_argument("--closed-tokens", type=int, default=256, help="tokens per closed-loop request (256)")
    p.add_argument("--closed-requests", type=int,
                   help="requests per agent with 32 agents or more (3; quick 2)")
    p.add_argument("--closed-requests-few", type=int,
                   help="requests per agent with fewer agents (6; quick 3)")
    p.add_argument("--closed-rounds", type=int, help="closed-loop rounds (3; quick 1)")
    p.add_argument("--closed-spread", type=float, default=0.5,
                   help="the agents connect evenly over this many seconds (0.5)")
    p.add_argument("--burst", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="burst agent counts, comma separated; empty skips (64,8; quick 64)")
    p.add_argument("--bursts", type=int, help="measured bursts per target and round, after "
                   "one that opens the connections (3; quick 1)")
    p.add_argument("--burst-rounds", type=int, help="burst rounds (5; quick 1)")
    p.add_argument("--no-burst-floor", dest="burst_floor", action="store_false",
                   help="no tcp-proxy in the burst")
    p.add_argument("--burst-distinct", action="store_true",
                   help="each burst agent its own conversation (default: all the same "
                        "\"Hello\", which the port takes for one session)")
    p.add_argument("--llama-tokens", type=int,
                   help="tokens per real-engine stream, 0 skips the real engine (200; quick 32)")
    p.add_argument("--llama-engines", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 2], help="real-engine pool sizes, comma separated (1,2); the "
                   "closed loop runs over one engine when 1 is among them")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                   help="also measure a patched port in the closed loop: FILE patches, then "
                        "calls backend.app.cli.main(sys.argv[1:]) (repeatable)")
    p.add_argument("--against", action="append", default=[], metavar="NAME=CHECKOUT",
                   help="also measure the port of another checkout (e.g. a git archive of a "
                        "commit) in the closed loop and the burst (repeatable)")
    p.add_argument("--skip-pool", action="store_true", help="skip the pool part")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = p.parse_args(argv)
    defaults = {"engines": ([1, 2, 4], [1, 2]), "rounds": (5, 1), "tokens": (100, 25),
                "newcomers": (40, 10), "steady_rounds": (3, 1), "short_requests": (50, 10),
                "clients": ([64, 8], [64]), "closed_requests": (3, 2),
                "closed_requests_few": (6, 3), "closed_rounds": (3, 1),
                "burst": ([64, 8], [64]), "bursts": (3, 1), "burst_rounds": (5, 1),
                "llama_tokens": (200, 32)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    variants = []
    for spec in args.variant:
        name, _, path = spec.partition("=")
        if not name or not path or name in {"port", "direct", "tcp-proxy"}:
            p.error("--variant takes NAME=FILE, NAME not one of port, direct, tcp-proxy")
        variants.append((name, str(Path(path).resolve())))
    args.variant = variants
    against: list[tuple[str, str]] = []
    for spec in args.against:
        name, _, path = spec.partition("=")
        taken = {"port", "direct", "tcp-proxy", *(n for n, _ in variants), *(n for n, _ in against)}
        if not name or not path or name in taken:
            p.error("--against takes NAME=CHECKOUT, NAME not one of port, direct, tcp-proxy "
                    "or another port's")
        if not (Path(path) / "backend").is_dir():
            p.error(f"--against {spec}: no backend/ in {path}")
        against.append((name, str(Path(path).resolve())))
    args.against = against
    return args


async def main_async(args: argparse.Namespace, procs: Processes, work: Path) -> int:
    started = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    pool = [] if args.skip_pool else await pool_part(args, procs, work, log)
    routing = {n: routing_cpu(n, args.routing_iterations) for n in (1, 2, 4, 16)}
    closed = await closed_part(args, procs, work, log) if args.clients else []
    bursts = await burst_part(args, procs, work, log) if args.burst else []
    real = await real_part(args, procs, work, log) if args.llama_tokens > 0 else None

    out = [f"pool benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {machine_note()}; "
           f"{time.monotonic() - started:.0f} s{' (quick)' if args.quick else ''}", ""]
    verdicts: list[str] = []
    if pool:
        rows, v = pool_throughput_table(pool, SLOTS, args.tokens, args.delay)
        out += [*rows, ""]
        verdicts += v
        rows, v = pool_newcomer_table(pool, SLOTS)
        out += [*rows, ""]
        verdicts += v
    out += [*routing_table(routing, pool, SLOTS), ""]
    for s in closed:
        rows, v = closed_loop_table(s)
        out += [*rows, ""]
        verdicts += v
    for s in bursts:
        rows, v = burst_table(s)
        out += [*rows, ""]
        verdicts += v
    if real is not None:
        out += [*real_engine_tables(real, SLOTS, args.llama_tokens), ""]
    errors = sum(r.errors for p in pool for runs in p.throughput.values() for r in runs)
    errors += sum(r.errors for p in pool if p.steady for runs in p.steady.runs.values()
                  for r in runs)
    errors += sum(s.errors() for s in [*closed, *bursts])
    if real is not None:
        errors += sum(r.errors for p in real.pool for runs in p.throughput.values() for r in runs)
        errors += real.closed.errors() if real.closed is not None else 0
    out += ["Targets:", *(verdicts or ["- none judged in this run"]), f"stream errors: {errors}"]
    print("\n".join(out), flush=True)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_bench(main_async, args, "gguf-studio-pool-bench-", config_dir=True)


if __name__ == "__main__":
    sys.exit(main())
