"""Where the port's time goes in a burst: each port profiled while N agents in lockstep
send their requests together (`load_generator.run_burst`, as `bench/pool.py --burst`
does), this checkout's and others' side by side.

    python bench/burst_profile.py --against before=/tmp/before-52cece1            # cProfile
    python bench/burst_profile.py --profiler perf --against before=/tmp/before-52cece1

Each port runs alone against the synthetic upstream (`tests/fake_upstream.py`, one token
per `--delay`, a context of 4096 tokens a slot: no prompt is counted by the engine, none
waits for room), one after the other, per round: it is started, warmed by one burst,
then profiled over `--bursts` bursts of `--agents` agents.  With the default 2-token
answers nearly all the port's work is per request (its way in, its few chunks, its
books); `--tokens 256` shows the chunks' share too.

- `cprofile` (`bench/variants/profiled_port.py`, the event loop's thread): every Python
  function's calls (deterministic; a coroutine's every resumption is a call) and its
  time, own ("self") and under it ("total").  The time is the wall clock's, with
  cProfile's own cost (about a µs a call) and, on a loaded machine, the time the port
  waited for a core (mostly in the socket writes that wake another process): read the
  times as shares and as differences between ports profiled alike.  C called from Python
  (json, hashlib, a socket's write) is its own entry, `{built-in method ...}` /
  `{method ...}`.
- `perf` (`perf record -e cpu-clock`, the whole process): where the CPU went while the
  port ran on one, whatever the load, by library (the interpreter, json, the kernel's
  sockets, libc) and symbol; no Python function names (Python 3.11 has no perf
  trampoline).

Figures are µs per request (the profiled bursts' requests), summed over rounds; then, for
each other port, what moved most against this checkout's.  Beside them, the port's CPU
per request over the same bursts (every thread, the scheduler's clock: profiled, so
above the unprofiled port's with cProfile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.load_generator import Run, run_burst  # noqa: E402
from bench.processes import (HOST, Processes, Target, cpu_ns, run_bench,  # noqa: E402
                             start_fake, start_port)
from bench.report import machine_note  # noqa: E402
from bench.scenarios import synthetic_body  # noqa: E402

PROFILED_PORT = ROOT / "bench" / "variants" / "profiled_port.py"
CHECKOUT_PORT = ROOT / "bench" / "variants" / "checkout_port.py"
Seconds = defaultdict[str, float]


@dataclass
class Port:
    name: str
    checkout: Path | None  # None: this checkout
    #: A file that patches the port and runs it (`--variant`, perf only).
    script: str | None = None
    requests: int = 0
    cpu: float = 0.0  # seconds of the port's CPU over the profiled bursts
    #: Per key (a function, or a library and symbol for perf), summed over rounds:
    #: seconds of its own, seconds under it (cProfile), calls (cProfile).
    own: Seconds = field(default_factory=lambda: defaultdict(float))
    under: Seconds = field(default_factory=lambda: defaultdict(float))
    calls: Counter[str] = field(default_factory=Counter)
    #: perf: seconds per library.
    libraries: Seconds = field(default_factory=lambda: defaultdict(float))

    def us(self, seconds: float) -> float:
        return seconds / self.requests * 1e6 if self.requests else 0.0


async def measure(port: Port, args: argparse.Namespace, procs: Processes, work: Path,
                  upstream: str, fake_pid: int, round_no: int) -> None:
    out = work / f"{port.name}-{round_no}.{args.profiler}"
    target = _start(port, args, procs, work, upstream, out)
    assert target.pid is not None
    body: bytes | list[bytes] = synthetic_body(args.tokens, args.delay)
    if args.turns:
        body = [agent_body(i, args.turns, args.tokens, args.delay) for i in range(args.agents)]
    elif args.distinct:  # each agent its own conversation, so its own session
        body = [synthetic_body(args.tokens, args.delay, content=f"Hello from agent {i}")
                for i in range(args.agents)]
    timeout = 60 + args.tokens * args.delay * 4
    try:
        await run_burst(target, [fake_pid], args.agents, 1, body, args.tokens, timeout)  # warm
        if args.profiler == "perf":
            perf = subprocess.Popen([args.perf, "record", "-q", "-e", "cpu-clock", "-F",
                                     str(args.perf_rate), "-p", str(target.pid), "-o", str(out)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            await asyncio.sleep(0.5)  # perf attaches (a wait for it, not a measure)
            if perf.poll() is not None:
                raise RuntimeError("perf record failed: " + (perf.stderr.read().decode()
                                                             if perf.stderr else ""))
        else:
            os.kill(target.pid, signal.SIGUSR1)
        cpu_before = cpu_ns(target.pid)
        run = await run_burst(target, [fake_pid], args.agents, args.bursts, body, args.tokens,
                              timeout)
        cpu = (cpu_ns(target.pid) - cpu_before) / 1e9
        if args.profiler == "perf":
            perf.send_signal(signal.SIGINT)
            perf.wait(60)
        else:
            os.kill(target.pid, signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not out.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{port.name} wrote no profile")
                await asyncio.sleep(0.05)
        if run.errors:
            raise RuntimeError(f"{port.name}: {run.errors} requests failed")
        requests = args.agents * (args.bursts + 1)  # run_burst's first burst is profiled too
        port.requests += requests
        port.cpu += cpu
        if args.profiler == "perf":
            symbols, libraries = read_perf(args.perf, out, args.perf_rate)
            _add(port.own, symbols)
            _add(port.libraries, libraries)
            seen = sum(libraries.values())
        else:
            own, under, calls = read_stats(out)
            _add(port.own, own)
            _add(port.under, under)
            port.calls.update(calls)
            seen = sum(own.values())
        print(f"round {round_no + 1}/{args.rounds} {port.name}: {seen / requests * 1e6:.0f} µs "
              f"profiled, {cpu / requests * 1e6:.0f} µs CPU per request, TTFT p50 "
              f"{_p50_ms(run):.1f} ms, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    finally:
        for child_name, proc in list(procs.children):
            if child_name == port.name:
                procs.stop(proc)
                procs.children.remove((child_name, proc))


def agent_body(agent: int, turns: int, tokens: int, delay: float) -> bytes:
    """A coding agent's request after `turns` turns: a system prompt of ~6 KB, three
    tools, then user and assistant messages of ~1 KB each, the assistant's with a tool
    call (its arguments its own: each agent reads its own files) and its result (about
    6 + 2.5 × turns KB in all); its first user message names the agent, so each is its
    own session."""
    words = ("function return value error import class module test file path string list "
             "index buffer stream token parse build change commit branch merge request "
             "async await result option config server client socket thread queue").split()
    rng = random.Random(agent)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    tools = [{"type": "function", "function": {
        "name": name, "description": text(40),
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": text(12)},
            "content": {"type": "string", "description": text(12)}},
            "required": ["path"]}}} for name in ("read_file", "write_file", "run")]
    messages: list[dict[str, Any]] = [{"role": "system", "content": text(900)},
                                      {"role": "user", "content": f"agent {agent}: " + text(150)}]
    for turn in range(turns):
        call = f"call_{agent}_{turn}"
        messages += [
            {"role": "assistant", "content": text(60), "tool_calls": [
                {"id": call, "type": "function", "function": {
                    "name": "read_file",
                    "arguments": json.dumps({"path": f"src/{agent}/{turn}.py"})}}]},
            {"role": "tool", "tool_call_id": call, "content": text(150)},
            {"role": "user", "content": text(60)}]
    return json.dumps({"model": "fake-model", "stream": True, "messages": messages,
                       "tools": tools, "fake": {"n_tokens": tokens, "delay": delay}}).encode()


def _start(port: Port, args: argparse.Namespace, procs: Processes, work: Path, upstream: str,
           out: Path) -> Target:
    env: dict[str, str] = {}
    script: str | None = None
    if args.profiler == "cprofile":
        env["PROFILE_OUT"] = str(out)
        script = str(PROFILED_PORT)
    elif port.script is not None:
        script = port.script
    elif port.checkout is not None:
        script = str(CHECKOUT_PORT)
    if port.checkout is not None:
        env["BENCH_CHECKOUT"] = str(port.checkout)
    saved = os.environ.pop("BENCH_CHECKOUT", None)  # this checkout's is never another's
    try:
        return start_port(procs, port.name, upstream, args.agents, work / f"cfg-{port.name}",
                          script, env=env)
    finally:
        if saved is not None:
            os.environ["BENCH_CHECKOUT"] = saved


def _p50_ms(run: Run) -> float:
    ttfts = sorted(run.ttfts)
    return ttfts[len(ttfts) // 2] * 1e3 if ttfts else float("nan")


def _add(into: Seconds, more: Seconds) -> None:
    for key, seconds in more.items():
        into[key] += seconds


def _top(values: Seconds, n: int) -> list[tuple[str, float]]:
    return sorted(values.items(), key=lambda item: -item[1])[:n]


def read_stats(path: Path) -> tuple[Seconds, Seconds, Counter[str]]:
    """Per function key (`function (file)`): its own seconds, the seconds under it, its
    calls (a coroutine's every resumption is a call)."""
    own: Seconds = defaultdict(float)
    under: Seconds = defaultdict(float)
    calls: Counter[str] = Counter()
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    for (file, _line, name), (_primitive, ncalls, tottime, cumtime, _callers) in stats.items():
        key = _key(file, name)
        own[key] += tottime
        under[key] += cumtime
        calls[key] += ncalls
    return own, under, calls


def _key(file: str, name: str) -> str:
    """A function keeps its key when its module moves to another package (as in
    `bench/opcodes.py`); C functions are cProfile's `{built-in method ...}`."""
    if file == "~":
        return name
    return f"{name} ({Path(file).name})"


_PERF_LINE = re.compile(r"^\s*[\d.]+%\s+(\d+)\s+(\S+)\s+\[[.k]\]\s+(.+?)\s*$")


def read_perf(perf: str, path: Path, rate: int) -> tuple[Seconds, Seconds]:
    """Seconds per `library: symbol` and per library, from `perf report`."""
    report = subprocess.run([perf, "report", "-i", str(path), "--stdio", "--no-children",
                             "--sort", "dso,sym", "-F", "overhead,sample,dso,sym"],
                            capture_output=True, text=True, check=False).stdout
    symbols: Seconds = defaultdict(float)
    libraries: Seconds = defaultdict(float)
    for line in report.splitlines():
        match = _PERF_LINE.match(line)
        if match is None:
            continue
        samples, library, symbol = int(match.group(1)), match.group(2), match.group(3)
        library = _library(library)
        symbols[f"{library}: {symbol}"] += samples / rate
        libraries[library] += samples / rate
    return symbols, libraries


def _library(name: str) -> str:
    """`_json.cpython-311-x86_64-linux-gnu.so` -> `_json`; `[kernel.kallsyms]` stays."""
    if name.startswith("["):
        return name
    return Path(name).name.split(".cpython-")[0].split(".so")[0]


def report(ports: list[Port], args: argparse.Namespace) -> list[str]:
    what = ("cProfile, the event loop's thread" if args.profiler == "cprofile"
            else f"perf record -e cpu-clock at {args.perf_rate} Hz, every thread")
    rows = [f"burst profile, {time.strftime('%Y-%m-%d %H:%M')}, {machine_note()}; "
            f"{args.rounds} rounds of {args.bursts + 1} bursts × {args.agents} agents, "
            f"{args.tokens}-token answers at {args.delay * 1e3:g} ms a token"
            f"{', each agent its own conversation' if args.distinct else ''}"
            f"{f', each agent a conversation of {args.turns} turns' if args.turns else ''}; "
            f"{what}", "",
            "| port | requests | CPU µs per request | profiled µs per request "
            + ("| calls per request |" if args.profiler == "cprofile" else "|"),
            "|---|---|---|---|" + ("---|" if args.profiler == "cprofile" else "")]
    for p in ports:
        seen = sum(p.libraries.values()) if args.profiler == "perf" else sum(p.own.values())
        rows.append(f"| {p.name} | {p.requests:,} | {p.us(p.cpu):.0f} | {p.us(seen):.0f} |"
                    + (f" {sum(p.calls.values()) / p.requests:,.0f} |"
                       if args.profiler == "cprofile" else ""))
    if args.profiler == "perf":
        names = sorted({lib for p in ports for lib in p.libraries},
                       key=lambda lib: -ports[0].libraries[lib])
        rows += ["", "CPU µs per request by library:", "",
                 "| library | " + " | ".join(p.name for p in ports) + " |",
                 "|---|" + "---|" * len(ports)]
        for lib in names:
            if max(p.us(p.libraries[lib]) for p in ports) >= 1.0:
                rows.append(f"| {lib} | " + " | ".join(f"{p.us(p.libraries[lib]):.0f}"
                                                      for p in ports) + " |")
    for p in ports:
        if args.profiler == "cprofile":
            rows += ["", f"{p.name}: the {args.top} functions with the most time under them, "
                         "µs per request (self / total), calls per request", ""]
            for key, seconds in _top(p.under, args.top):
                rows.append(f"  {p.us(p.own[key]):7.1f} / {p.us(seconds):7.1f}  "
                            f"{p.calls[key] / p.requests:6.2f}  {key}")
        rows += ["", f"{p.name}: the {args.top} with the most time of their own, µs per request"
                     + (", calls per request" if args.profiler == "cprofile" else ""), ""]
        for key, seconds in _top(p.own, args.top):
            calls = f"  {p.calls[key] / p.requests:6.2f}" if args.profiler == "cprofile" else ""
            rows.append(f"  {p.us(seconds):7.1f}{calls}  {key}")
    base = ports[0]
    for other in ports[1:]:
        rows += ["", f"what moved most, own time, {base.name} − {other.name}, µs per request"
                     + (" (calls per request)" if args.profiler == "cprofile" else "") + ":", ""]
        names_moved = set(base.own) | set(other.own)

        def moved(key: str) -> float:
            return base.us(base.own[key]) - other.us(other.own[key])

        for key in sorted(names_moved, key=lambda k: -abs(moved(k)))[:args.top]:
            calls = (f"; calls {base.calls[key] / base.requests:.2f} vs "
                     f"{other.calls[key] / other.requests:.2f}"
                     if args.profiler == "cprofile" else "")
            rows.append(f"  {moved(key):+7.1f}  ({base.us(base.own[key]):6.1f} vs "
                        f"{other.us(other.own[key]):6.1f}{calls})  {key}")
    return rows


async def main_async(args: argparse.Namespace, procs: Processes, work: Path) -> int:
    fake_target, fake = start_fake(procs, "fake-upstream", args.agents,
                                   args.agents * args.n_ctx, enforce_slots=True)
    upstream = f"http://{HOST}:{fake_target.port}"
    ports = [Port("this", None)] + [Port(name, path) for name, path in args.against]
    ports += [Port(name, None, script) for name, script in args.variant]
    for r in range(args.rounds):
        for port in (ports if r % 2 == 0 else ports[::-1]):
            await measure(port, args, procs, work, upstream, fake.pid, r)
    print("\n".join(report(ports, args)))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", action="append", default=[], metavar="NAME=CHECKOUT",
                   help="another checkout's port to profile beside this one (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                   help="with --profiler perf: also a patched port, FILE patching this "
                        "checkout's and running backend.app.cli.main (repeatable)")
    p.add_argument("--profiler", choices=("cprofile", "perf"), default="cprofile",
                   help="cProfile in the port (Python functions) or perf (CPU by library)")
    p.add_argument("--agents", type=int, default=64, help="agents of each burst (64)")
    p.add_argument("--bursts", type=int, default=30,
                   help="bursts profiled per port and round, after a warm-up one (30)")
    p.add_argument("--tokens", type=int, default=2, help="tokens of each answer (2)")
    p.add_argument("--delay", type=float, default=0.02, help="seconds per token (0.02)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each port once a round (3)")
    p.add_argument("--turns", type=int, default=0,
                   help="each agent a coding agent's conversation of this many turns "
                        "(a system prompt, tools, ~2.5 KB a turn; its own session); 0: "
                        "\"Hello\" (0)")
    p.add_argument("--n-ctx", type=int, default=4096,
                   help="the synthetic upstream's context per agent (4096: a \"Hello\" is "
                        "neither counted by the engine nor waits; give longer "
                        "conversations more, or they are counted before admission)")
    p.add_argument("--distinct", action="store_true",
                   help="each agent its own conversation (default: all the same \"Hello\", "
                        "which the port takes for one session)")
    p.add_argument("--top", type=int, default=30, help="functions or symbols listed (30)")
    p.add_argument("--perf", default=shutil.which("perf") or "perf", help="the perf program")
    p.add_argument("--perf-rate", type=int, default=4999, help="perf samples a second (4999)")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    against = []
    for item in args.against:
        name, _, path = item.rpartition("=")
        if not (Path(path) / "backend").is_dir():
            p.error(f"--against {item}: no backend/ in {path}")
        against.append((name or Path(path).name, Path(path).resolve()))
    args.against = against
    variants = []
    for item in args.variant:
        name, _, path = item.partition("=")
        if not name or not Path(path).is_file():
            p.error(f"--variant {item}: NAME=FILE, FILE a file")
        variants.append((name, str(Path(path).resolve())))
    if variants and args.profiler != "perf":
        p.error("--variant needs --profiler perf")
    args.variant = variants
    if args.profiler == "perf" and shutil.which(args.perf) is None and not Path(args.perf).exists():
        p.error("perf not found (--perf PATH)")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_bench(main_async, parse_args(argv), "gguf-studio-burst-profile-")


if __name__ == "__main__":
    sys.exit(main())
