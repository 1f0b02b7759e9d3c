"""What OpenTelemetry export costs the port: its CPU per request with spans off and on.

    python bench/tracing.py                 # synthetic upstream, 200 and 500 tokens (~2 min)
    python bench/tracing.py --quick         # a smoke run (~20 s)
    python bench/tracing.py --real          # the real llama-server on the tiny model instead
    python bench/tracing.py --against /tmp/main-snapshot   # also another checkout's spans

Two ports run side by side, each `gguf-studio serve` in its own process: `off` as users
start it, `on` with `--otel-endpoint` pointing at a local OTLP/HTTP sink (another process
that parses each export and counts its spans), so every span takes the real path: the
SDK's batch processor, its protobuf encoding and an HTTP POST from the exporter's thread.
`--against [NAME=]CHECKOUT` (repeatable) adds a port of that checkout (e.g. a `git archive`
of main), spans on, to the same sink, as NAME (`on-other`).

Each round runs the same load through every port at the same time (so whatever else
this shared machine does weighs on each alike; which port's clients start first rotates
round by round): `--streams` clients per port, each
sending `--requests` streamed chat requests of `--tokens` tokens one after the other on a
kept-alive connection.  A round ends when the sink has every span of it, so the
exporter's work is inside the round.  Each port's CPU is its whole process's
(`time.process_time()` in it: every thread, the exporter's included, read through a
pipe, nanoseconds rather than /proc's 10 ms ticks) over the round.  Figures: CPU per
request, medians over rounds, and the median of the per-round ratios on ÷ off (the
machine is shared: the ratio is what to read).  Beside them, to place an added cost: the
port's loop thread's CPU and its other threads' (each thread's own CPU clock), and the
garbage collector's runs by generation and their time (`gc.callbacks` in the port).  A port's idle CPU (it polls its
upstream) is printed: it is in every figure alike.

Upstreams: by default the synthetic one (`tests/fake_upstream.py`, as fast as it goes: the
port's cheapest chunks, so the span's share is at its largest); `--real`: each port
starts and supervises its own llama-server on the tiny random model
(`tests/model_factory.py`), `--parallel 4`, as users start it.

Every child gets temporary HOME and XDG directories; every process started here is
ended on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.load_generator import Agent, chat_request  # noqa: E402
from bench.processes import (HOST, PYTHON, Processes, _die_with_parent,  # noqa: E402
                             get_json, health_slots, run_bench, stop_children, wait_until)
from bench.report import machine_note  # noqa: E402
from bench.scenarios import llama_body, median, synthetic_body  # noqa: E402

#: The fd on which a port started here answers "cpu" requests (its stdin) with its CPU.
CPU_FD_ENV = "BENCH_CPU_FD"
REAL_SLOTS = 4


@dataclass
class Port:
    """A `gguf-studio serve` started here, whose CPU it reports on request."""

    name: str
    proc: subprocess.Popen[bytes]
    answers: Any  # the read end of its CPU pipe
    port: int = 0
    cpu: list[float] = field(default_factory=list)  # seconds per request, by round
    #: The garbage collector's runs by generation and their seconds, then the CPU seconds
    #: of the port's loop thread and of its other Python threads, at the last reading.
    collections: list[float] = field(default_factory=lambda: [0.0] * 6)
    collected: list[list[float]] = field(default_factory=list)  # per request, by round

    def process_time(self) -> float:
        """Its CPU seconds; `collections` becomes its collector's figures so far."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"cpu\n")
        self.proc.stdin.flush()
        cpu, *collections = (float(x) for x in self.answers.readline().split())
        self.collections = collections
        return cpu


# --- the children: a port that tells its CPU, and the OTLP sink ---------------------------

def port_child(checkout: str, argv: list[str]) -> int:
    """`gguf-studio serve ARGV` of `checkout`, answering each line on stdin with this
    process's CPU seconds (every thread) on the fd named by BENCH_CPU_FD."""
    sys.path.insert(0, checkout)
    out = os.fdopen(int(os.environ[CPU_FD_ENV]), "w", buffering=1)
    collections = [0, 0, 0]
    collecting = [0.0, 0.0]  # the seconds of all runs so far, the current one's start

    def collector(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting[1] = time.perf_counter()
        else:
            collections[info["generation"]] += 1
            collecting[0] += time.perf_counter() - collecting[1]

    gc.callbacks.append(collector)

    loop = threading.main_thread().ident  # the port's event loop runs on it

    def answer() -> None:
        for _ in sys.stdin:
            cpu = time.process_time()
            threads = {thread.ident: thread_time(thread.ident)
                       for thread in threading.enumerate()
                       if thread is not threading.current_thread()}
            on_loop = threads.pop(loop, 0.0)
            out.write(f"{cpu:.9f} {collections[0]} {collections[1]} {collections[2]} "
                      f"{collecting[0]:.9f} {on_loop:.9f} {sum(threads.values()):.9f}\n")

    threading.Thread(target=answer, daemon=True).start()
    from backend.app.cli import main
    return main(argv)


def thread_time(ident: int | None) -> float:
    """A thread's CPU seconds so far (0 once it ended)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident or 0))
    except (OSError, OverflowError):
        return 0.0


def sink_child() -> int:
    """An OTLP/HTTP trace receiver: parses every export, counts its spans (GET /count)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest, ExportTraceServiceResponse)

    spans = 0
    lock = threading.Lock()
    answer = ExportTraceServiceResponse().SerializeToString()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            nonlocal spans
            message = ExportTraceServiceRequest()
            message.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                spans += sum(len(scope.spans) for resource in message.resource_spans
                             for scope in resource.scope_spans)
            self._send(answer, "application/x-protobuf")

        def do_GET(self) -> None:
            with lock:
                self._send(json.dumps({"spans": spans}).encode(), "application/json")

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
    print(f"otlp sink on http://{HOST}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


# --- the run ----------------------------------------------------------------------------

def child_env(work: Path) -> dict[str, str]:
    """No saved settings, no GGUF_STUDIO_* leaking in, never the user's own dirs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GGUF_STUDIO_", "OTEL_"))}
    for name in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME",
                 "XDG_STATE_HOME"):
        (work / name).mkdir(exist_ok=True)
        env[name] = str(work / name)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_port(procs: Processes, work: Path, name: str, checkout: Path, serve: list[str],
               slots: int) -> Port:
    read, write = os.pipe()
    env = child_env(work)
    env[CPU_FD_ENV] = str(write)
    log = open(procs.log_dir / f"{name}.log", "wb")
    try:
        proc = subprocess.Popen([PYTHON, __file__, "--port-child", str(checkout), "serve",
                                 *serve, "--host", HOST, "--port", "0"],
                                cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=log,
                                stderr=subprocess.STDOUT, pass_fds=(write,),
                                preexec_fn=_die_with_parent)
    finally:
        log.close()
        os.close(write)
    procs.children.append((name, proc))
    port = Port(name, proc, os.fdopen(read, "r"))
    port.port = int(procs.wait_for_line(name, proc, r"http://127\.0\.0\.1:(\d+)/v1",
                                        180).group(1))
    wait_until(lambda: health_slots(get_json(port.port, "/health")[1]) == slots, proc,
               f"{name} did not become ready with {slots} slots", procs, name, 180)
    return port


def sink_spans(sink: int) -> int:
    return int(get_json(sink, "/count")[1]["spans"])


async def load(port: Port, body: bytes, streams: int, requests: int,
               tokens: int | None) -> int:
    """The round's load through `port` (each answer `tokens` content chunks, when
    given); returns the requests that failed."""
    agents = [Agent(chat_request(port.port, body), requests, tokens) for _ in range(streams)]
    await asyncio.gather(*(agent.run(port.port, 300.0) for agent in agents))
    return sum(agent.errors for agent in agents)


async def run_rounds(ports: list[Port], body: bytes, args: argparse.Namespace, sink: int,
                     log: Any, rounds: int) -> int:
    """`rounds` rounds, each the same load through every port at once; each port's CPU
    per request is appended to its `cpu`.  Returns the failed requests."""
    tracing = sum(1 for port in ports if port.name != "off")
    per_round = args.streams * args.requests
    expect = None if args.real else args.tokens
    errors = 0
    for index in range(rounds):
        expected = sink_spans(sink) + tracing * per_round
        before = [port.process_time() for port in ports]
        collections_before = [port.collections for port in ports]
        started = time.monotonic()
        # Rotated round by round: the clients of the port first in line connect first.
        order = ports[index % len(ports):] + ports[:index % len(ports)]
        done = await asyncio.gather(*(load(port, body, args.streams, args.requests, expect)
                                      for port in order))
        errors += sum(done)
        deadline = time.monotonic() + 60
        while sink_spans(sink) < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if sink_spans(sink) < expected:
            raise RuntimeError(f"the sink got {sink_spans(sink)} spans, not {expected}")
        for port, then, collections in zip(ports, before, collections_before):
            port.cpu.append((port.process_time() - then) / per_round)
            port.collected.append([(a - b) / per_round
                                   for a, b in zip(port.collections, collections)])
        log(f"round {index + 1}: {time.monotonic() - started:.1f} s, "
            + ", ".join(f"{p.name} {p.cpu[-1] * 1e6:.0f} µs" for p in ports)
            + f", on/off {ports[1].cpu[-1] / ports[0].cpu[-1]:.3f}; collections a request "
            + ", ".join(f"{p.name} " + "/".join(f"{n:.2f}" for n in p.collected[-1][:3])
                        + f" {p.collected[-1][3] * 1e6:.0f} µs" for p in ports)
            + "; loop / other threads µs a request "
            + ", ".join(f"{p.name} {p.collected[-1][4] * 1e6:.0f} / "
                        f"{p.collected[-1][5] * 1e6:.0f}" for p in ports))
    return errors


async def measure(args: argparse.Namespace, procs: Processes, work: Path, tokens: int,
                  log: Any) -> tuple[list[Port], float]:
    """Every port of one run (one answer length); the idle CPU per second of `off`."""
    sink_proc = procs.start("sink", [PYTHON, __file__, "--sink"], env=child_env(work))
    sink = int(procs.wait_for_line("sink", sink_proc,
                                   r"otlp sink on http://127\.0\.0\.1:(\d+)").group(1))
    endpoint = ["--otel-endpoint", f"http://{HOST}:{sink}/v1/traces"]
    if args.real:
        from backend.llama.engine import Engine
        from tests.model_factory import write_tiny_model

        engine = Engine()  # the built one, found in the real data dir before HOME moves
        chosen = engine.resolve(backends=["cpu"]).chosen
        if chosen is None or chosen.path is None:
            raise RuntimeError("no llama-server binary: run scripts/setup first")
        vocab = (await engine.source_tree_async()) / "models" / "ggml-vocab-llama-spm.gguf"
        model = work / "tiny.gguf"
        if not model.exists():
            write_tiny_model(model, vocab)
        serve = ["--model", f"tiny={model}", "--parallel", str(REAL_SLOTS),
                 "--llama-server", str(chosen.path)]
        slots = REAL_SLOTS
        body = llama_body(tokens)
    else:
        slots = args.streams
        fake = procs.start("fake-upstream", [
            PYTHON, "-m", "tests.fake_upstream", "--host", HOST, "--port", "0",
            "--slots", str(slots), "--n-ctx", str(slots * 4096)], env=child_env(work))
        upstream = int(procs.wait_for_line(
            "fake-upstream", fake, r"fake llama-server on http://127\.0\.0\.1:(\d+)").group(1))
        serve = ["--upstream", f"http://{HOST}:{upstream}", "--max-output-tokens", "0"]
        body = synthetic_body(tokens, args.delay)
    ports = [start_port(procs, work, "off", REPO, serve, slots),
             start_port(procs, work, "on", REPO, serve + endpoint, slots)]
    for name, checkout in args.against:
        ports.append(start_port(procs, work, name, checkout, serve + endpoint, slots))
    idle_before = ports[0].process_time()
    await asyncio.sleep(2.0)
    idle = (ports[0].process_time() - idle_before) / 2.0
    log(f"{tokens} tokens: ports " + ", ".join(f"{p.name} pid {p.proc.pid}" for p in ports)
        + f"; idle {idle * 1e6:.0f} µs CPU/s")
    args_tokens = args.tokens
    args.tokens = tokens
    try:
        await run_rounds(ports, body, args, sink, log, 1)  # warm-up, not counted
        for port in ports:
            port.cpu.clear()
        if await run_rounds(ports, body, args, sink, log, args.rounds):
            raise RuntimeError("some requests failed (see the logs: --keep-logs)")
    finally:
        args.tokens = args_tokens
    stop_children(procs)
    return ports, idle


def table(results: list[tuple[int, list[Port], float]], args: argparse.Namespace) -> list[str]:
    upstream = ("llama-server, tiny model, --parallel 4" if args.real
                else f"synthetic, {args.delay * 1e3:g} ms/token")
    lines = ["| upstream | tokens | requests/round | port | CPU µs/request | ÷ off (range) "
             "| added µs/request | loop thread added | other threads added "
             "| GC runs/request (gen 0/1/2) | GC µs/request |",
             "|---|---:|---:|---|---:|---|---:|---:|---:|---|---:|"]
    for tokens, ports, _ in results:
        off = ports[0]
        for port in ports:
            ratios = [a / b for a, b in zip(port.cpu, off.cpu)]
            added = [(a - b) * 1e6 for a, b in zip(port.cpu, off.cpu)]

            def more(column: int) -> str:
                if port is off:
                    return f"{median([r[column] for r in off.collected]) * 1e6:.0f}"
                pairs = zip(port.collected, off.collected)
                return f"{median([(a[column] - b[column]) * 1e6 for a, b in pairs]):+.0f}"

            runs = "/".join(f"{median([r[g] for r in port.collected]):.2f}" for g in range(3))
            lines.append(
                f"| {upstream} | {tokens} | {args.streams * args.requests} | {port.name} "
                f"| {median(port.cpu) * 1e6:.0f} | {median(ratios):.3f} "
                f"({min(ratios):.3f}–{max(ratios):.3f}) "
                f"| {'—' if port is off else f'{median(added):+.0f}'} | {more(4)} | {more(5)} "
                f"| {runs} | {median([r[3] for r in port.collected]) * 1e6:.0f} |")
    return lines


async def main_async(args: argparse.Namespace, procs: Processes, work: Path) -> int:
    started = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    load_before = machine_note().split("at the end ")[-1]
    results = []
    for tokens in args.token_counts:
        ports, idle = await measure(args, procs, work, tokens, log)
        results.append((tokens, ports, idle))
    idle_note = ", ".join(f"{tokens} tokens {idle * 1e6:.0f}" for tokens, _, idle in results)
    print(f"tracing benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {machine_note()} "
          f"(at the start {load_before}); {time.monotonic() - started:.0f} s; "
          f"{args.rounds} rounds of {args.streams} clients × {args.requests} requests; "
          f"idle port µs CPU/s: {idle_note}")
    print("\n".join(table(results, args)), flush=True)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, fewer requests")
    p.add_argument("--real", action="store_true",
                   help="the real llama-server (tiny model, --parallel 4, managed by each port)")
    p.add_argument("--tokens", dest="token_counts", default="200,500",
                   type=lambda s: [int(x) for x in s.split(",")],
                   help="tokens per answer, one run each, comma separated (200,500)")
    p.add_argument("--rounds", type=int, help="rounds per run (7; quick 2)")
    p.add_argument("--streams", type=int,
                   help="clients at once (8; with --real 4, the slots)")
    p.add_argument("--requests", type=int,
                   help="requests per client per round (40; --real 10; quick 10)")
    p.add_argument("--delay", type=float, default=0.0,
                   help="synthetic upstream: seconds per token (0: as fast as it goes)")
    p.add_argument("--against", action="append", default=[], metavar="[NAME=]CHECKOUT",
                   type=lambda s: (s.partition("=")[0], Path(s.partition("=")[2])) if "=" in s
                   else ("on-other", Path(s)),
                   help="also run this checkout's port with spans on, as NAME (on-other); "
                        "repeatable")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.streams = args.streams or (REAL_SLOTS if args.real else 8)
    args.requests = args.requests or (10 if args.quick or args.real else 40)
    args.tokens = 0
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--port-child"]:
        return port_child(argv[1], argv[2:])
    if argv[:1] == ["--sink"]:
        return sink_child()
    args = parse_args(argv)
    return run_bench(main_async, args, "gguf-studio-tracing-bench-")


if __name__ == "__main__":
    sys.exit(main())
