"""Fair shares between keys at the port (issue 18): three named keys whose agents keep 1,
4 and 16 requests in flight, through a real GGUF Studio port, next to today's FIFO; and
the admission's CPU per request with 100 flows.

    .venv/bin/python bench/fairness.py                       # about 6 minutes
    .venv/bin/python bench/fairness.py --llama-threads 0,1   # llama-server twice
    .venv/bin/python bench/fairness.py --quick               # about 2 minutes
    .venv/bin/python bench/fairness.py --help

**Shares and waits.**  One `gguf-studio serve --upstream URL` with three named keys (made
with the KeyStore API in a config dir of the benchmark's own) and an owner's key.  Each
agent sends its next streamed request the moment its last one ended.  Two modes, in the
same run, alternating round by round on the same port and upstream:

- **fair**: each group of agents sends its own key (three flows);
- **FIFO**: every agent sends the owner's key.  The port has no switch to turn its fair
  queue off, and it needs none: one flow is served first come, first served
  (backend/port/fair_queue.py), which is the line the port had before flows.

Per key: its share of the content chunks (tokens) streamed during the measured window,
and its queue wait, p50 / p99: time to first token minus the same port's time to first
token for a lone request (the service's own part).  The queue line is the admission's;
the engines behind it are the synthetic upstream (`tests/fake_upstream.py`: 4 slots,
20 ms per token) and a real llama-server started as users start it (`-m MODEL -np 4`,
its default cache and threads; `--llama-threads` adds runs with --threads N) with the
tiny model of tests/model_factory.py.
"Max-min fair" is the share each key would get if the slots were split max-min fairly
(a key can hold no more slots than it has agents); FIFO tends to the agents' proportion.

**Admission CPU.**  In-process, no I/O: a `Line` in front of one `AdmissionQueue` (32
slots, a pool that fits everyone), 500 requests waiting and 32 running; each step one
request arrives (`Line.request`) and the oldest running one is released, which admits
the next.  With 100 flows (fair) and with one flow (today's FIFO), and the `Line` as it
was before the fair queue (git `FIFO_COMMIT`, read with `git show`, when git is there),
alternating round by round; medians of process CPU per request.  Target: fair at most
20 µs more than FIFO.  (bench/fairness_core.py measures the queue alone, and DRR.)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load_generator import StreamClient, chat_request, start_stream  # noqa: E402
from bench.processes import (HOST, PYTHON, REPO, Processes, Target, free_port,  # noqa: E402
                             get_json, start_port, stop_children, wait_until)
from bench.scenarios import llama_body, quantile, synthetic_body  # noqa: E402

#: The last commit whose Line was a plain FIFO (the fair queue came with the next).
FIFO_COMMIT = "9a6a057^"
CPU_FLOWS = 100
CPU_WAITING = 500
CPU_RUNNING = 32
TARGET_EXTRA_US = 20.0


def main() -> int:
    args = parse_args()
    print(f"fairness benchmark, {time.strftime('%Y-%m-%d %H:%M')}, load average "
          f"{Path('/proc/loadavg').read_text().split()[0]} at the start\n")
    cpu_ok = True
    if args.cpu_requests:
        cpu_ok = print_cpu(args)
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp:
        work = Path(tmp)
        procs = Processes(work)
        try:
            results = asyncio.run(shares_and_waits(args, procs, work))
        finally:
            procs.stop_all()
    for title, table in results:
        print(title + "\n")
        print("\n".join(table) + "\n")
    return 0 if cpu_ok else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short windows, one round")
    p.add_argument("--agents", default="1,4,16", help="agents per key (one key each)")
    p.add_argument("--rounds", type=int, default=3, help="fair and FIFO once each per round")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per mode")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    p.add_argument("--slots", type=int, default=4, help="the synthetic upstream's slots")
    p.add_argument("--delay", type=float, default=0.02, help="synthetic seconds per token")
    p.add_argument("--tokens", type=int, default=25, help="synthetic tokens per request")
    p.add_argument("--llama-tokens", type=int, default=64,
                   help="tokens per request on llama-server (0: skip it)")
    p.add_argument("--llama-parallel", type=int, default=4, help="llama-server's -np")
    p.add_argument("--llama-threads", default="0",
                   help="llama-server's --threads, a run for each of a comma-separated list "
                        "(0: not given, its own default, as users start it)")
    p.add_argument("--upstreams", default="synthetic,llama",
                   help="which upstreams to measure behind the port")
    p.add_argument("--cpu-requests", type=int, default=40_000,
                   help="admissions per CPU round (0: skip)")
    p.add_argument("--cpu-rounds", type=int, default=7)
    args = p.parse_args()
    args.agents = [int(n) for n in args.agents.split(",")]
    args.upstreams = set(args.upstreams.split(","))
    args.llama_threads = [int(n) for n in args.llama_threads.split(",")]
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 8.0, 2.0
        args.cpu_requests, args.cpu_rounds = min(args.cpu_requests, 5_000), 3
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- shares and waits through the port ---------------------------------------------

@dataclass
class KeyRun:
    """One key's agents in one mode of one round."""

    name: str
    agents: int
    clients: list[StreamClient] = field(default_factory=list)
    tokens: int = 0          # content chunks streamed in the window
    waits: list[float] = field(default_factory=list)  # seconds, requests sent in the window
    errors: Counter[str] = field(default_factory=Counter)  # by what went wrong


@dataclass
class Keys:
    names: list[str]
    secrets: dict[str, str]
    owner: str


async def shares_and_waits(args: argparse.Namespace, procs: Processes,
                           work: Path) -> list[tuple[str, list[str]]]:
    config = work / "config"
    keys = make_keys(config, args.agents)
    results = []
    if "synthetic" in args.upstreams:
        upstream, slots = start_fake(procs, args)
        body = synthetic_body(args.tokens, args.delay)
        title = (f"synthetic upstream ({slots} slots, {args.delay * 1e3:g} ms/token, "
                 f"{args.tokens} tokens a request)")
        results.append(await compare(title, args, procs, config, keys, upstream, slots, body))
        stop_children(procs)
    llama_runs = args.llama_threads if "llama" in args.upstreams and args.llama_tokens else []
    for threads in llama_runs:
        started = await start_llama(procs, work, args, threads)
        if started is not None:
            upstream, slots, what = started
            body = llama_body(args.llama_tokens)
            title = f"llama-server, {what}, {args.llama_tokens} tokens a request"
            results.append(await compare(title, args, procs, config, keys, upstream, slots,
                                         body))
            stop_children(procs)
    return results


def make_keys(config: Path, agents: list[int]) -> Keys:
    """Named keys, one per group of agents, and the owner's key, in `config` (the
    port's XDG_CONFIG_HOME), as `gguf-studio keys add` and the window make them."""
    from backend.api_keys import generate_api_key
    from backend.keys.key_store import KeyStore
    from backend.settings import APP_NAME, Settings

    folder = config / APP_NAME
    store = KeyStore(folder / "keys.json")
    names: list[str] = []
    secrets: dict[str, str] = {}
    for n in agents:
        name = f"agents-{n}" if f"agents-{n}" not in secrets else f"agents-{n}-{len(names)}"
        secrets[name] = store.add(name)[1]
        names.append(name)
    owner = generate_api_key()
    settings = folder / "settings.json"
    Settings.load(settings, environ={}).replace(api_key=owner).save(settings, environ={})
    return Keys(names, secrets, owner)


def start_fake(procs: Processes, args: argparse.Namespace) -> tuple[str, int]:
    # One pool of 4,096 tokens a slot, reported as the per-slot context (as llama-server
    # with a unified cache does): every request fits; only slots make anyone wait.
    fake = procs.start("fake-upstream", [PYTHON, "-m", "tests.fake_upstream", "--host", HOST,
                                         "--port", "0", "--slots", str(args.slots),
                                         "--n-ctx", str(args.slots * 4096)])
    port = int(procs.wait_for_line("fake-upstream", fake,
                                   r"fake llama-server on http://127\.0\.0\.1:(\d+)").group(1))
    return f"http://{HOST}:{port}", args.slots


async def start_llama(procs: Processes, work: Path, args: argparse.Namespace,
                      threads: int) -> tuple[str, int, str] | None:
    """llama-server as a user starts it: the model, -np, a port; nothing else."""
    from backend.llama.engine import Engine
    from tests.model_factory import write_tiny_model

    engine = Engine()
    chosen = engine.resolve().chosen
    if chosen is None or chosen.path is None:
        log("no llama-server binary found (run scripts/setup): real llama-server part skipped")
        return None
    vocab_path = (await engine.source_tree_async()) / "models" / "ggml-vocab-llama-spm.gguf"
    model = write_tiny_model(work / "tiny.gguf", vocab_path)
    port = free_port()
    command = [str(chosen.path), "-m", str(model), "-np", str(args.llama_parallel),
               "--host", HOST, "--port", str(port)]
    if threads:
        command += ["--threads", str(threads)]
    server = procs.start("llama-server", command)

    def healthy() -> bool:
        return get_json(port, "/health")[0] == 200

    wait_until(healthy, server, "llama-server did not become healthy", procs, "llama-server",
               120)
    slots = get_json(port, "/props")[1]["total_slots"]
    given = f"--threads {threads}" if threads else "its default threads"
    return f"http://{HOST}:{port}", slots, f"tiny model, -np {slots}, {given}"


async def compare(title: str, args: argparse.Namespace, procs: Processes, config: Path,
                  keys: Keys, upstream: str, slots: int, body: bytes) -> tuple[str, list[str]]:
    port = start_port(procs, "port", upstream, slots, config)
    kv = get_json(port.port, "/health")[1]["kv"]
    title += (f"; the port's view of its cache: {'one pool' if kv['unified'] else 'split'}"
              f" of {kv['total']:,} tokens, up to {kv['per_request']:,} a request")
    log(f"{title}: port pid {port.pid} on :{port.port}")
    service = await lone_ttft(port, body, keys.owner)
    log(f"  a lone request's time to first token through the port: {service * 1e3:.1f} ms")
    runs: dict[str, list[dict[str, KeyRun]]] = {"fair": [], "FIFO": []}
    for round_ in range(args.rounds):
        for mode in (("fair", "FIFO") if round_ % 2 == 0 else ("FIFO", "fair")):
            result = await run_mode(mode, port, keys, body, service, args)
            runs[mode].append(result)
            log(f"  round {round_ + 1} {mode:<4}: " + ", ".join(
                f"{r.name} {r.tokens} tokens ({len(r.waits)} requests"
                + (f", errors: {dict(r.errors)})" if r.errors else ")")
                for r in result.values()))
            await settle(port)
    heading = (f"{title}; {args.rounds} round(s) of {args.seconds:g} s per mode after "
               f"{args.warmup:g} s of warm-up; a lone request's first token "
               f"{service * 1e3:.1f} ms (subtracted from every wait)")
    return heading, share_table(keys, args.agents, slots, runs)


async def lone_ttft(port: Target, body: bytes, secret: str, n: int = 9) -> float:
    """The median time to first token of a request alone at the port."""
    request = chat_request(port.port, body, secret)
    ttfts = []
    for _ in range(n):
        client, task = start_stream(port.port, request, 60.0)
        await task
        if client.status != 200 or not client.tokens:
            raise RuntimeError(f"a lone request failed: HTTP {client.status}")
        ttfts.append(client.t_first - client.t_send)
    return statistics.median(ttfts)


async def run_mode(mode: str, port: Target, keys: Keys, body: bytes, service: float,
                   args: argparse.Namespace) -> dict[str, KeyRun]:
    """Every key's agents at once for warm-up + window; the window's tokens and waits."""
    runs = {name: KeyRun(name, n) for name, n in zip(keys.names, args.agents)}
    stop = False

    async def agent(run: KeyRun, request: bytes) -> None:
        while not stop:
            client, task = start_stream(port.port, request, 300.0)
            run.clients.append(client)
            await task

    agents = []
    for run in runs.values():
        secret = keys.secrets[run.name] if mode == "fair" else keys.owner
        request = chat_request(port.port, body, secret)
        agents += [asyncio.create_task(agent(run, request)) for _ in range(run.agents)]
    await asyncio.sleep(args.warmup)
    start, before = time.perf_counter(), {r.name: _tokens(r) for r in runs.values()}
    await asyncio.sleep(args.seconds)
    end, after = time.perf_counter(), {r.name: _tokens(r) for r in runs.values()}
    # The load goes on until every request sent in the window has its first token: its
    # wait is measured whole, under the same load (none is cut short at the window's end).
    sent = [c for r in runs.values() for c in r.clients if start <= c.t_send <= end]
    deadline = end + 300
    while any(not (c.t_first or c.t_end) for c in sent) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    cut = time.perf_counter()
    stop = True
    for task in agents:
        task.cancel()
    await asyncio.gather(*agents, return_exceptions=True)
    for run in runs.values():
        run.tokens = after[run.name] - before[run.name]
        for c in run.clients:
            if c.transport is not None and not c.transport.is_closing():
                c.transport.close()
            in_window = start <= c.t_send <= end
            if in_window and c.t_first:
                run.waits.append(c.t_first - c.t_send - service)
            ended_badly = 0 < c.t_end <= cut and not (c.status == 200 and c.saw_done
                                                       and c.tokens)
            if ended_badly or (in_window and not c.t_first):
                run.errors[_what_failed(c)] += 1
    return runs


def _what_failed(c: StreamClient) -> str:
    if c.status != 200:
        return f"HTTP {c.status}" if c.status else "no answer"
    if not c.t_first:
        return "no token"
    return "no [DONE]" if not c.saw_done else "?"


def _tokens(run: KeyRun) -> int:
    return sum(c.tokens for c in run.clients)


async def settle(port: Target, timeout: float = 60.0) -> None:
    """Wait until the port runs and queues nothing (the agents of a mode were cut off)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            health = get_json(port.port, "/health")[1]
            if health["active"] == 0 and health["waiting"] == 0:
                return
        except (OSError, http.client.HTTPException):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("the port did not become idle between modes")


def max_min_shares(agents: list[int], slots: int) -> list[float]:
    """Each key's share of `slots` split max-min fairly, a key holding at most as many
    slots as it has agents (water-filling)."""
    shares = [0.0] * len(agents)
    left, open_ = float(slots), set(range(len(agents)))
    while open_ and left > 1e-9:
        even = left / len(open_)
        capped = {i for i in open_ if agents[i] - shares[i] <= even}
        if not capped:
            for i in open_:
                shares[i] += even
            break
        for i in capped:
            left -= agents[i] - shares[i]
            shares[i] = agents[i]
        open_ -= capped
    return [s / slots for s in shares]


def share_table(keys: Keys, agents: list[int], slots: int,
                runs: dict[str, list[dict[str, KeyRun]]]) -> list[str]:
    ideal = max_min_shares(agents, slots)
    rows = ["| key (agents) | max-min fair share | fair: share of tokens | FIFO: share of "
            "tokens | fair: queue wait p50 / p99 ms | FIFO: queue wait p50 / p99 ms "
            "| requests measured fair / FIFO | errors fair / FIFO |",
            "|---|---|---|---|---|---|---|---|"]
    shares: dict[str, dict[str, list[float]]] = {}
    for mode, rounds in runs.items():
        totals = [sum(r.tokens for r in result.values()) or 1 for result in rounds]
        shares[mode] = {name: [result[name].tokens / total
                               for result, total in zip(rounds, totals)]
                        for name in keys.names}
    for i, name in enumerate(keys.names):
        cells = [f"{name} ({agents[i]})", f"{ideal[i]:.3f}"]
        for mode in ("fair", "FIFO"):
            values = shares[mode][name]
            spread = (f" ({min(values):.3f}–{max(values):.3f})" if len(values) > 1 else "")
            cells.append(f"{statistics.median(values):.3f}{spread}")
        waits = {mode: [w for result in runs[mode] for w in result[name].waits]
                 for mode in ("fair", "FIFO")}
        for mode in ("fair", "FIFO"):
            cells.append(f"{quantile(waits[mode], 0.5) * 1e3:.0f} / "
                         f"{quantile(waits[mode], 0.99) * 1e3:.0f}")
        cells.append(f"{len(waits['fair'])} / {len(waits['FIFO'])}")
        cells.append(" / ".join(str(sum(result[name].errors.total() for result in runs[mode]))
                                for mode in ("fair", "FIFO")))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


# --- admission CPU, in-process ------------------------------------------------------

def print_cpu(args: argparse.Namespace) -> bool:
    log(f"admission CPU: {args.cpu_rounds} rounds of {args.cpu_requests:,} requests")
    rows = cpu_rows(args.cpu_requests, args.cpu_rounds)
    fifo = rows[0][1]
    print(f"Admission CPU per request, in-process (a Line and one AdmissionQueue, no I/O): "
          f"{CPU_WAITING} waiting, {CPU_RUNNING} running, {args.cpu_requests:,} requests x "
          f"{args.cpu_rounds} rounds, median of process CPU\n")
    print("| line | µs per request | vs one flow |\n|---|---|---|")
    for name, micros in rows:
        print(f"| {name} | {micros:.2f} | {micros - fifo:+.2f} |")
    fair = dict(rows)[f"fair queue, {CPU_FLOWS} flows"]
    ok = fair - fifo <= TARGET_EXTRA_US
    print(f"\n{CPU_FLOWS} flows cost {fair - fifo:+.2f} µs per request over one flow (target "
          f"<= {TARGET_EXTRA_US:g} µs): {'met' if ok else 'NOT met'}")
    if len(rows) > 2:
        before = rows[2][1]
        print(f"{CPU_FLOWS} flows cost {fair - before:+.2f} µs per request over the Line before "
              f"the fair queue: {'within' if fair - before <= TARGET_EXTRA_US else 'NOT within'}"
              f" {TARGET_EXTRA_US:g} µs")
    print()
    return ok


def cpu_rows(requests: int, rounds: int) -> list[tuple[str, float]]:
    """(line, median µs of CPU per request); one flow first."""
    from backend.admission.engine_queue import AdmissionQueue
    from backend.admission.line import Line

    admission = types.SimpleNamespace(AdmissionQueue=AdmissionQueue, Line=Line)
    rng = random.Random(18)
    flows = [rng.randrange(CPU_FLOWS) for _ in range(requests + CPU_WAITING + CPU_RUNNING)]
    costs = [rng.randint(200, 6000) for _ in flows]
    variants: list[tuple[str, Callable[[], float]]] = [
        ("fair queue, one flow (today's FIFO)",
         lambda: line_round(admission, costs, [0] * len(flows), requests)),
        (f"fair queue, {CPU_FLOWS} flows", lambda: line_round(admission, costs, flows, requests)),
    ]
    old = line_before_fair_queue()
    if old is not None:
        variants.append((f"the Line before the fair queue (git {FIFO_COMMIT})",
                         lambda: line_round(old, costs, None, requests)))
    samples: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, run in variants:
            samples[name].append(run())
    return [(name, statistics.median(samples[name])) for name, _ in variants]


def line_round(module: Any, costs: list[int], flows: list[int] | None, requests: int) -> float:
    """CPU µs per request through `module`'s Line (`flows` None: a Line without flows)."""
    from backend.llama.kv_capacity import KvCapacity, TokenNeed
    from backend.llama.load import Serving
    from backend.admission.flow import Flow

    taken: deque[Any] = deque()

    class Engine(module.AdmissionQueue):  # type: ignore[misc]
        def take(self, ticket: Any, now: float, seat: Any = None) -> None:
            super().take(ticket, now, seat)
            taken.append(ticket)

    line = module.Line()
    Engine(Serving("http://bench", CPU_RUNNING, kv=KvCapacity.shared(10**9)), line=line)
    keys = [Flow(f"key{i}") for i in range(CPU_FLOWS)]
    needs = [TokenNeed(cost, 0) for cost in costs]
    if flows is None:
        def request(i: int) -> None:
            line.request(needs[i])
    else:
        def request(i: int) -> None:
            line.request(needs[i], flow=keys[flows[i]])
    for i in range(CPU_WAITING + CPU_RUNNING):
        request(i)
    assert len(taken) == CPU_RUNNING and line.waiting == CPU_WAITING
    gc.collect()
    started = time.process_time_ns()
    for i in range(CPU_WAITING + CPU_RUNNING, CPU_WAITING + CPU_RUNNING + requests):
        request(i)
        taken.popleft().release()
    spent = time.process_time_ns() - started
    assert len(taken) == CPU_RUNNING and line.waiting == CPU_WAITING
    return spent / requests / 1000


def line_before_fair_queue() -> types.ModuleType | None:
    """backend/port/admission.py (and its ticket) as of FIFO_COMMIT, as modules of their
    own; None when git cannot show them."""
    modules = {}
    for name, path in (("_fifo_admission_ticket", "backend/port/admission_ticket.py"),
                       ("_fifo_admission", "backend/port/admission.py")):
        try:
            source = subprocess.run(["git", "-C", str(REPO), "show", f"{FIFO_COMMIT}:{path}"],
                                    capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            log(f"git cannot show {path} at {FIFO_COMMIT}: that row is left out")
            return None
        source = source.replace("from backend.admission.admission_ticket import",
                                "from _fifo_admission_ticket import")
        module = types.ModuleType(name)
        module.__file__ = f"{FIFO_COMMIT}:{path}"
        sys.modules[name] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        modules[name] = module
    return modules["_fifo_admission"]


if __name__ == "__main__":
    raise SystemExit(main())
