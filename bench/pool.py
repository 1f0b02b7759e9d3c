"""Pool benchmark: the port in front of N engines, and directly, side by side in one run.

    python bench/pool.py            # the full run (about 15 minutes)
    python bench/pool.py --quick    # a smoke run (about 3 minutes)

1. Pool: N = 1, 2, 4 synthetic engines (`tests/fake_upstream.py --enforce-slots`: 4
   slots each, a request beyond them waits as on llama-server; one token per 20 ms)
   behind one `gguf-studio serve --upstream A --upstream B ...`:
   - throughput: 4N streams through the port, against 4 on each engine directly and 4
     on one engine alone (target: the port's rate >= 0.95 x N x one engine's);
   - newcomer: 4N-1 streams flow and newcomers arrive one by one, each taking the one
     free slot: the time to first token the port adds over going directly to the
     engine with the free slot (targets: p50 <= 2 ms, p99 <= 10 ms);
   - routing CPU per request: the admission decision in this process (µs, for N
     engines), and the port process's whole CPU per short request (from /proc).
   Until `serve` takes `--upstream` more than once, only N = 1 runs, and the output
   says so; `--pool-via-service` runs N > 1 meanwhile through
   `bench/variants/pool_upstreams_port.py` (the others attached through the service).
2. Closed loop: C agents (64 and 8), each on its own kept-alive connection, sending its
   next request the moment the last one's answer ended (as coding agents do), 256 tokens
   at 20 ms per token, to one synthetic engine of C slots: the time to first token the
   port adds over direct (p50, p99; target 2 ms), next to the byte-forwarding tcp-proxy.
   `--variant NAME=FILE` adds a patched port, or another checkout's
   (`bench/variants/checkout_port.py`): before and after in one run.
3. The real llama-server with the tiny test model (`tests/model_factory.py`), started as
   users start it (`-np 4`, its default split cache; `--threads 1` on this shared
   machine): throughput, newcomer and closed loop (4 agents), through the port as
   attached (`serve --upstream URL`, the cache's layout unstated) and with
   `--upstream-kv split`, against direct.  Not judged: the tiny model streams far faster
   than the realistic rate.

Every round runs every target of a scenario one after the other, and the figures are
medians over rounds of per-round ratios or differences (see bench/README.md).  Only
loopback addresses are used; every process started here is ended on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.load_generator import Run, chat_request, one_stream, run_closed_loop  # noqa: E402
from bench.processes import (HOST, Processes, Target, cpu_times, free_port,  # noqa: E402
                             get_json, start_fake, start_helper, start_port, stop_children,
                             wait_until)
from bench.report import (closed_loop_table, machine_note, pool_newcomer_table,  # noqa: E402
                          pool_throughput_table, real_engine_tables, routing_table)
from bench.scenarios import (Scenario, Steady, llama_body, median,  # noqa: E402
                             run_steady_rounds, synthetic_body)

#: Slots of each synthetic engine of the pool.
SLOTS = 4
#: The context each synthetic engine reports for a slot: an attached port takes it as one
#: pool shared by the slots, in which 4 requests of the default output budget fit.
POOL_CTX = SLOTS * 4096
LOG = Callable[[str], None]


# --- the pool ------------------------------------------------------------------------------


def pool_supported() -> tuple[bool, str]:
    """Whether `gguf-studio serve` takes `--upstream` more than once (read from its
    argument parser), and if not, why not."""
    try:
        from backend.app import cli
        parser = cli._parser()
        subparsers = next(a for a in parser._actions
                          if isinstance(a, argparse._SubParsersAction))
        serve = subparsers.choices["serve"]
        upstream = next(a for a in serve._actions if "--upstream" in a.option_strings)
    except Exception as exc:  # a bench reading another module's internals: say, never crash
        return False, f"serve's options could not be read ({type(exc).__name__}: {exc})"
    if isinstance(upstream, argparse._AppendAction) or upstream.nargs in ("+", "*"):
        return True, ""
    return False, "this checkout's `serve` takes --upstream once"


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


async def pool_part(args: argparse.Namespace, procs: Processes, work: Path,
                    log: LOG) -> list[PoolResult]:
    results = []
    for n in args.engines:
        engines = [start_fake(procs, f"engine{n}-{i}", SLOTS, POOL_CTX, enforce_slots=True)
                   for i in range(n)]
        direct = [target for target, _ in engines]
        pids = [proc.pid for _, proc in engines]
        urls = [f"http://{HOST}:{t.port}" for t in direct]
        port = start_port(procs, "port", urls, SLOTS * n, work / "config",
                          patch=args.pool_launcher if n > 1 else None, need_kv=n == 1)
        log(f"pool of {n}: engines on " + ", ".join(f":{t.port}" for t in direct)
            + f"; port pid {port.pid} on :{port.port}")
        result = PoolResult(n)
        body = synthetic_body(args.tokens, args.delay)
        timeout = 60 + args.tokens * args.delay * 4
        # One engine alone, every engine directly (4 streams each), and the port (4N).
        plans = {"one engine": [direct[0].port] * SLOTS,
                 "direct": [t.port for t in direct for _ in range(SLOTS)],
                 "port": [port.port] * (SLOTS * n)}
        result.throughput = {name: [] for name in plans}
        result.waited = {name: 0 for name in plans}
        for i in range(args.rounds):
            line = []
            for name, ports in plans.items():
                waited = engines_waited(direct)
                run = await run_streams(name, port.pid if name == "port" else None, pids,
                                        ports, body, args.tokens, timeout)
                result.waited[name] += engines_waited(direct) - waited
                result.throughput[name].append(run)
                line.append(f"{name} {run.rate:,.0f} chunks/s"
                            + (f" ERRORS {run.errors}" if run.errors else ""))
            log(f"  pool of {n}, throughput round {i + 1}/{args.rounds}: " + " | ".join(line))

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
    before = {k: cpu_times(p) for k, p in pids.items()}
    started = time.perf_counter()
    clients = await asyncio.gather(*(one_stream(p, chat_request(p, body), timeout, 0.0)
                                     for p in ports))
    wall = time.perf_counter() - started
    cpu = {}
    for k, p in pids.items():
        user, system = cpu_times(p)
        cpu[k] = user + system - sum(before[k])
        cpu[k + "_sys"] = system - before[k][1]
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
    from backend.port.admission import AdmissionRegistry

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
        ports = [start_port(procs, "port", upstream, clients, work / "config")]
        for name, patch in args.variant:
            ports.append(start_port(procs, name, upstream, clients, work / "config", patch))
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
    """Every target in turn per round, `s.streams` agents of `s.requests` requests each."""
    s.runs = {t.name: [] for t in s.targets}
    for i in range(rounds):
        line = []
        for target in s.targets:
            run = await run_closed_loop(target, [s.upstream_pid], s.streams, s.requests,
                                        s.body, s.expect_tokens, s.timeout, s.spread)
            s.runs[target.name].append(run)
            line.append(f"{target.name} ttft p50 {_q(run.ttfts, 0.5):.1f} p99 "
                        f"{_q(run.ttfts, 0.99):.1f} ms" + (f" ERRORS {run.errors}" if run.errors else ""))
        log(f"  {s.title}, {s.streams} agents round {i + 1}/{rounds}: " + " | ".join(line))
    return s


def _q(values: list[float], q: float) -> float:
    from bench.scenarios import quantile
    return quantile(values, q) * 1e3


# --- the real engine -----------------------------------------------------------------------


@dataclass
class RealResult:
    title: str
    throughput: Scenario
    steady: Steady | None
    closed: Scenario
    note: str = ""


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
    port = free_port()
    # As users start it: -np 4, the default (split) cache and context; one thread, because
    # on this shared 2-core machine spinning worker threads stall when descheduled.
    cmd = [str(chosen.path), "--model", str(model), "--host", HOST, "--port", str(port),
           "-np", str(SLOTS), "--threads", "1"]
    server = procs.start("llama-server", cmd)
    wait_until(lambda: get_json(port, "/health")[0] == 200, server,
               "llama-server did not become healthy", procs, "llama-server", 120)
    props = get_json(port, "/props")[1]
    per_slot = props["default_generation_settings"]["n_ctx"]
    upstream = f"http://{HOST}:{port}"
    attached = start_port(procs, "port", upstream, SLOTS, work / "config")
    split = start_port(procs, "port-split", upstream, SLOTS, work / "config",
                       extra=["--upstream-kv", "split"])
    note = get_json(attached.port, "/health")[1].get("kv") or {}
    log(f"llama-server pid {server.pid} on :{port} (-np {props['total_slots']}, "
        f"{per_slot} tokens per slot); port pid {attached.pid} on :{attached.port} "
        f"(kv as attached: {json.dumps(note)}); port-split pid {split.pid} on :{split.port}")
    direct = Target("direct", port, None)
    title = f"llama-server -np {SLOTS}, tiny model"

    tokens = args.llama_tokens
    thr = Scenario(title, SLOTS, tokens, llama_body(tokens), server.pid,
                   [attached, split, direct], None, timeout=120, judged=False)
    from bench.scenarios import run_scenario
    await run_scenario(thr, args.rounds, log)
    per_stream = median([r.rate for r in thr.runs["direct"]]) / SLOTS  # tokens/s of a stream

    # Newcomers among 3 busy streams; the background must last the newcomers' window and
    # fit one slot's context.  Through the port as attached, 3 such streams do not fit its
    # assumed pool of one slot's context together: only port-split runs it.
    window = 0.5 + args.llama_newcomers * args.interval * 1.3 + 1.5
    length = min(int(per_stream * window * 1.5), per_slot - 64)
    steady = Steady(SLOTS - 1, args.llama_newcomers, args.interval, args.delay, server.pid,
                    [split, direct], timeout=120, background_length=length,
                    background_body=llama_body(length), newcomer_body=llama_body(2),
                    exact_tokens=False)
    await run_steady_rounds(steady, args.rounds, log)

    closed = Scenario(f"{title}, closed loop", SLOTS, args.closed_tokens,
                      llama_body(args.closed_tokens), server.pid, [attached, split, direct],
                      None, timeout=120, spread=0.0, requests=args.closed_requests_few)
    await closed_rounds(closed, args.rounds, log)
    stop_children(procs)
    return RealResult(title, thr, steady, closed,
                      note=f"{per_slot} tokens per slot; through `port` (layout unstated) "
                           f"the port assumes one pool of one slot's context: "
                           f"{json.dumps(note)}")


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
    p.add_argument("--llama-tokens", type=int,
                   help="tokens per real-engine stream, 0 skips the real engine (200; quick 32)")
    p.add_argument("--llama-newcomers", type=int, help="real engine: newcomers per round (10; quick 5)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                   help="also measure a patched port in the closed loop: FILE patches, then "
                        "calls backend.app.cli.main(sys.argv[1:]) (repeatable)")
    p.add_argument("--skip-pool", action="store_true", help="skip the pool part")
    p.add_argument("--pool-via-service", action="store_true",
                   help="while `serve` takes --upstream once: run N > 1 anyway, the other "
                        "upstreams attached through the service "
                        "(bench/variants/pool_upstreams_port.py)")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = p.parse_args(argv)
    defaults = {"engines": ([1, 2, 4], [1, 2]), "rounds": (5, 1), "tokens": (100, 25),
                "newcomers": (40, 10), "steady_rounds": (3, 1), "short_requests": (50, 10),
                "clients": ([64, 8], [64]), "closed_requests": (3, 2),
                "closed_requests_few": (6, 3), "closed_rounds": (3, 1),
                "llama_tokens": (200, 32), "llama_newcomers": (10, 5)}
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
    args.pool_launcher = None
    return args


async def main_async(args: argparse.Namespace, procs: Processes, work: Path) -> int:
    started = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    supported, why = pool_supported()
    if not supported and args.pool_via_service:
        args.pool_launcher = str(REPO / "bench" / "variants" / "pool_upstreams_port.py")
        why += ("; N > 1 is measured anyway, the other upstreams attached through the "
                "service (bench/variants/pool_upstreams_port.py)")
    elif not supported:
        args.engines = [n for n in args.engines if n == 1] or [1]
        why += ": only N = 1 runs"
    if not supported:
        log(why)
    pool = [] if args.skip_pool else await pool_part(args, procs, work, log)
    routing = {n: routing_cpu(n, args.routing_iterations) for n in (1, 2, 4, 16)}
    closed = await closed_part(args, procs, work, log) if args.clients else []
    real = await real_part(args, procs, work, log) if args.llama_tokens > 0 else None

    out = [f"pool benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {machine_note()}; "
           f"{time.monotonic() - started:.0f} s{' (quick)' if args.quick else ''}", ""]
    if not supported:
        out += [f"Note: {why}.", ""]
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
    if real is not None:
        out += [*real_engine_tables(real), ""]
    errors = sum(r.errors for p in pool for runs in p.throughput.values() for r in runs)
    errors += sum(r.errors for p in pool if p.steady for runs in p.steady.runs.values()
                  for r in runs)
    errors += sum(s.errors() for s in closed)
    if real is not None:
        errors += real.throughput.errors() + real.closed.errors()
        if real.steady is not None:
            errors += sum(r.errors for runs in real.steady.runs.values() for r in runs)
    out += ["Targets:", *(verdicts or ["- none judged in this run"]), f"stream errors: {errors}"]
    print("\n".join(out), flush=True)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gguf-studio-pool-bench-"))
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
