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
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.processes import (HOST, PYTHON, Processes, Target, free_port,  # noqa: E402
                             get_json, run_bench, start_helper, start_port, stop_children,
                             wait_until)
from bench.report import (TARGET_THROUGHPUT, TARGET_TTFT_P50_MS, TARGET_TTFT_P99_MS,  # noqa: E402
                          latency_table, machine_note, saturation_table, steady_table)
from bench.scenarios import (Scenario, Steady, llama_body, run_scenario,  # noqa: E402
                             run_steady_rounds, synthetic_body)

FAKE_CTX_PER_SLOT = 4096


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
    from backend.llama.engine import Engine
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
                        "backend.app.cli.main(sys.argv[1:]) (repeatable)")
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
    return run_bench(main_async, args, "gguf-studio-bench-", config_dir=True)


if __name__ == "__main__":
    sys.exit(main())
