"""Python bytecode instructions the port executes per request and per relayed chunk, this
checkout against others: a measure the machine's load cannot move.

    python bench/opcodes.py --against before=/tmp/main-snapshot     # e.g. a git archive
    python bench/opcodes.py --against before=/tmp/snap --by-function 25

CPU time on this shared 2-core machine moves by 10-20 % between runs of the same code
(bench/README.md), so the CPU benches (`bench/relay.py`, `bench/admission_cpu.py`) can
neither show nor rule out a 5 % change unless the machine is quiet.  The number of
bytecode instructions the port's Python runs does not depend on the load.  Each port
runs under a tracer once started (`bench/variants/count_opcodes.py`: about 30× slower)
against the synthetic upstream; per round and per port, one after the other:

- a closed loop of `--clients` agents × `--requests` requests of 2-token answers, then
  the same with 50-token answers, one token per 20 ms (`--delay`: an unpaced upstream
  outruns the traced port, several chunks share a read, and the count follows the
  timing);
- instructions per request = the first phase's ÷ its requests; per chunk = (the second's
  − the first's) ÷ (requests × 48 more chunks each);
- the port's own timers run meanwhile: their rate, measured idle before the phases, is
  taken out of each phase (`idle/s` in the table).

What the tracer cannot see is C: uvicorn's parser, json, the kernel.  So this shows
where the port's Python grew or shrank (`--by-function N` lists the N functions whose
per-request count moved most), not its whole CPU; read it beside the CPU benches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.load_generator import run_closed_loop  # noqa: E402
from bench.processes import HOST, Processes, run_bench, start_fake, start_port  # noqa: E402
from bench.burst_profile import agent_body  # noqa: E402
from bench.scenarios import synthetic_body  # noqa: E402

VARIANT = ROOT / "bench" / "variants" / "count_opcodes.py"
SHORT, LONG = 2, 50
IDLE_SECONDS = 3.0


@dataclass
class Port:
    name: str
    checkout: Path | None  # None: this checkout
    per_request: list[float] = field(default_factory=list)
    per_chunk: list[float] = field(default_factory=list)
    idle_rate: list[float] = field(default_factory=list)
    #: Per function, instructions per request of the short phase, summed over rounds.
    functions: dict[str, float] = field(default_factory=dict)


async def measure(port: Port, args: argparse.Namespace, procs: Processes, work: Path,
                  upstream: str, fake_pid: int) -> None:
    """One round of `port`: start it under the tracer, warm it, count both phases."""
    out = work / f"{port.name}.count"
    out.unlink(missing_ok=True)
    env = {"OPCODES_OUT": str(out)}
    if args.by_function:
        env["OPCODES_BY_FUNCTION"] = "1"
    if port.checkout is not None:
        env["BENCH_CHECKOUT"] = str(port.checkout)
    saved = {k: os.environ.get(k) for k in (*env, "BENCH_CHECKOUT")}
    os.environ.pop("BENCH_CHECKOUT", None)
    os.environ.update(env)
    try:
        target = start_port(procs, port.name, upstream, args.clients, work / f"cfg-{port.name}",
                            str(VARIANT))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        counter = _Counter(out, target.pid)
        await counter.read()  # counting starts
        await run_closed_loop(target, [fake_pid], args.clients, 2, _bodies(args, SHORT, 0.0),
                              None, 300)
        idle_from = await counter.read()
        started = time.perf_counter()
        await asyncio.sleep(IDLE_SECONDS)  # the measured idle time itself, not a wait for anything
        idle = (await counter.read() - idle_from) / (time.perf_counter() - started)
        requests = args.clients * args.requests
        phases = []
        for tokens in (SHORT, LONG):
            before = await counter.read()
            started = time.perf_counter()
            run = await run_closed_loop(target, [fake_pid], args.clients, args.requests,
                                        _bodies(args, tokens, args.delay), tokens, 600)
            if run.errors:
                raise RuntimeError(f"{port.name}: {run.errors} requests failed")
            spent = await counter.read() - before
            phases.append(spent - idle * (time.perf_counter() - started))
        port.idle_rate.append(idle)
        port.per_request.append(phases[0] / requests)
        port.per_chunk.append((phases[1] - phases[0]) / (requests * (LONG - SHORT)))
        if args.by_function:
            first, second = counter.functions(-4), counter.functions(-3)
            for name, n in second.items():
                moved = (n - first.get(name, 0)) / requests
                if moved:
                    port.functions[name] = port.functions.get(name, 0.0) + moved
    finally:
        _stop(procs, port.name)


def _bodies(args: argparse.Namespace, tokens: int, delay: float) -> bytes | list[bytes]:
    """Every agent's "Hello", or with `--turns` each agent's own conversation."""
    if args.turns:
        return [agent_body(i, args.turns, tokens, delay) for i in range(args.clients)]
    return synthetic_body(tokens, delay)


def table(ports: list[Port], args: argparse.Namespace) -> list[str]:
    base = ports[0]
    body = f"each agent a {args.turns}-turn conversation" if args.turns else '"Hello"'
    rows = [f"{args.rounds} rounds; {args.clients} agents × {args.requests} requests per "
            f"phase, {body}, --n-ctx {args.n_ctx}; medians over rounds", "",
            "| port | instructions per request (2-token answer) | ÷ this | "
            "per extra chunk | ÷ this | idle/s |", "|---|---|---|---|---|---|"]
    for p in ports:
        req, chunk = statistics.median(p.per_request), statistics.median(p.per_chunk)
        rows.append(f"| {p.name} | {req:,.0f} ({min(p.per_request):,.0f}-{max(p.per_request):,.0f}) | "
                    f"{req / statistics.median(base.per_request):.3f} | "
                    f"{chunk:,.1f} ({min(p.per_chunk):,.1f}-{max(p.per_chunk):,.1f}) | "
                    f"{chunk / statistics.median(base.per_chunk):.3f} | "
                    f"{statistics.median(p.idle_rate):,.0f} |")
    if args.by_function:
        for other in ports[1:]:
            rows += ["", f"functions whose instructions per request moved most, "
                         f"{base.name} − {other.name} (per request, mean over rounds):"]
            names = set(base.functions) | set(other.functions)
            moved = sorted(names, key=lambda n: -abs(base.functions.get(n, 0.0)
                                                     - other.functions.get(n, 0.0)))
            for name in moved[:args.by_function]:
                a = base.functions.get(name, 0.0) / args.rounds
                b = other.functions.get(name, 0.0) / args.rounds
                rows.append(f"  {a - b:+8.0f}  ({a:7.0f} vs {b:7.0f})  {name}")
    return rows


async def main_async(args: argparse.Namespace, procs: Processes, work: Path) -> int:
    fake_target, fake = start_fake(procs, "fake-upstream", args.clients, args.n_ctx)
    upstream = f"http://{HOST}:{fake_target.port}"
    ports = [Port("this", None)] + [Port(name, path) for name, path in args.against]
    for r in range(args.rounds):
        for port in (ports if r % 2 == 0 else ports[::-1]):
            await measure(port, args, procs, work, upstream, fake.pid)
            print(f"round {r + 1}/{args.rounds} {port.name}: {port.per_request[-1]:,.0f} per "
                  f"request, {port.per_chunk[-1]:,.1f} per chunk", file=sys.stderr, flush=True)
    print("\n".join(table(ports, args)))
    if args.save:
        Path(args.save).write_text(json.dumps({
            p.name: {"per_request": p.per_request, "per_chunk": p.per_chunk,
                     "idle_rate": p.idle_rate,
                     "functions": {k: v / args.rounds for k, v in p.functions.items()}}
            for p in ports}, indent=1))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", action="append", default=[], metavar="[NAME=]CHECKOUT",
                   help="another checkout to count beside this one (repeatable)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each port once per round (3)")
    p.add_argument("--clients", type=int, default=8, help="agents of the closed loop (8)")
    p.add_argument("--requests", type=int, default=20, help="requests per agent per phase (20)")
    p.add_argument("--delay", type=float, default=0.02,
                   help="seconds per token of the synthetic upstream (0.02): paced, each "
                        "chunk reaches the port in a read of its own, as a real engine's do")
    p.add_argument("--n-ctx", type=int, default=4096,
                   help="the synthetic upstream's context, which the port takes as one pool "
                        "for all its slots (4096: with 8 agents a request's share is 512 "
                        "tokens, below the default output budget, so every prompt is counted "
                        "by the engine and two requests fit at once; 8 x 4096 = 32768: none is "
                        "counted nor waits, as in bench/pool.py --burst)")
    p.add_argument("--turns", type=int, default=0,
                   help="each agent sends a coding agent's conversation of this many turns "
                        "(`bench/burst_profile.py`'s, ~6 + 2.5 x turns KB) instead of "
                        "\"Hello\": what walking a real body costs (give --n-ctx room, e.g. "
                        "8 x 65536 for 20 turns, or every prompt is counted)")
    p.add_argument("--by-function", type=int, default=0, metavar="N",
                   help="list the N functions whose per-request count moved most")
    p.add_argument("--save", metavar="FILE",
                   help="write each port's figures to FILE as JSON (with --by-function, "
                        "every function's instructions per request, mean over rounds)")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    against = []
    for item in args.against:
        name, _, path = item.rpartition("=")
        against.append((name or Path(path).name, Path(path).resolve()))
    args.against = against
    return args


def main(argv: list[str] | None = None) -> int:
    return run_bench(main_async, parse_args(argv), "gguf-studio-opcodes-bench-")


# --- helpers ------------------------------------------------------------------------------

class _Counter:
    """Reads the traced port's count: SIGUSR1, then wait for its line."""

    def __init__(self, out: Path, pid: int) -> None:
        self.out, self.pid = out, pid

    async def read(self) -> int:
        lines = self._lines()
        os.kill(self.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = self._lines()
            if len(now) > len(lines):
                return int(now[-1])
            await asyncio.sleep(0.02)
        raise RuntimeError("the traced port did not report its count")

    def functions(self, back: int) -> dict[str, int]:
        """The per-function counts of the `back`-th last read (-1: the last)."""
        n = len(self._lines()) + 1 + back
        return json.loads(Path(f"{self.out}.{n}.json").read_text())

    def _lines(self) -> list[str]:
        return self.out.read_text().split() if self.out.exists() else []


def _stop(procs: Processes, name: str) -> None:
    for child_name, proc in list(procs.children):
        if child_name == name:
            procs.stop(proc)
            procs.children.remove((child_name, proc))


if __name__ == "__main__":
    sys.exit(main())
