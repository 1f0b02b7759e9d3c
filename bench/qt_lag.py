"""How late the window's Qt loop runs while streams pass through the port.

Runs the real app (tests/studio/exit_probe.py) with the real engine and the tiny model,
sends STREAMS concurrent streamed chat requests from another process while the Chat tab
streams answers of its own (shown, a new message whenever one ends; --no-chat: the
Activity tab instead), and prints the lag
of a 10 ms Qt timer (p50/p99/max) next to the time the Qt thread itself was busy.  The
wall-clock lag includes the time the OS gave the CPU to other programs (the engine and
the clients share this machine's cores); the busy figure is the window's own work.

    .venv/bin/python bench/qt_lag.py [--streams 64] [--max-tokens 64] [--runs 3]
                                     [--loops uvloop,asyncio] [--no-chat]

`--loops` runs the backend thread on each event loop in turn, run by run (uvloop's is the
default where installed; asyncio's is GGUF_STUDIO_EVENT_LOOP=asyncio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backend.llama.engine import Engine  # noqa: E402
from tests.model_factory import write_tiny_model  # noqa: E402
from tests.studio.conftest import free_port, private_environment  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--loops", default="uvloop",
                        help="backend event loops to compare, comma separated: uvloop, asyncio")
    parser.add_argument("--engine-threads", type=int, default=0,
                        help="llama-server --threads (0: llama-server decides)")
    parser.add_argument("--no-chat", action="store_true",
                        help="show the Activity tab instead of the Chat tab streaming answers")
    parser.add_argument("--details", action="store_true",
                        help="also print each run's whole report (the collector's passes...)")
    args = parser.parse_args()
    engine = Engine()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = write_tiny_model(tmp_path / "tiny.gguf",
                                 engine.source_tree() / "models" / "ggml-vocab-llama-spm.gguf")
        loops = [name.strip() for name in args.loops.split(",") if name.strip()]
        reports = [dict(run_once(tmp_path / f"run{i}-{loop}", engine.resolve().path, model,
                                 args, loop), loop=loop)
                   for i in range(args.runs) for loop in loops]
    threads = args.engine_threads or "llama-server's choice"
    print(f"Qt loop with {args.streams} streams x {args.max_tokens} tokens through the port"
          f"{'' if args.no_chat else ' and the Chat tab streaming'}, "
          f"engine threads: {threads} ({args.runs} runs, load average before: "
          f"{os.getloadavg()[0]:.1f}):")
    print(f"{'run':>4} {'loop':>8} {'lag p50':>9} {'lag p99':>9} {'lag max':>9} {'busy p99':>9} "
          f"{'ticks':>6} {'chat answers':>13} {'chat chars':>11}")
    for i, r in enumerate(reports):
        print(f"{i // len(loops) + 1:>4} {r['backend_loop'].split('.')[0]:>8} {r['lag_p50_ms']:>7} ms "
              f"{r['lag_p99_ms']:>6} ms {r['lag_max_ms']:>6} ms {r['busy_p99_ms']:>6} ms "
              f"{r['ticks']:>6} {r.get('chat_answers', '-'):>13} {r.get('chat_chars', '-'):>11}")
    if args.details:
        for r in reports:
            print(json.dumps({k: v for k, v in r.items() if k != "statuses"}))
    for loop in loops:
        p99 = statistics.median(r["lag_p99_ms"] for r in reports if r["loop"] == loop)
        print(f"{loop}: median lag p99 {p99} ms (target <= 50 ms)")
    return 0


def run_once(home: Path, binary: Path, model: Path, args: argparse.Namespace,
             loop: str) -> dict:
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    if loop == "asyncio":
        env["GGUF_STUDIO_EVENT_LOOP"] = "asyncio"
    env.update(private_environment(home))
    env.update(GGUF_STUDIO_LLAMA_SERVER=str(binary), GGUF_STUDIO_PORT=str(free_port()),
               PYTHONPATH=str(REPO), QT_QPA_PLATFORM=env.get("QT_QPA_PLATFORM", "offscreen"),
               PROBE_ENGINE_THREADS=str(args.engine_threads),
               PROBE_CHAT="0" if args.no_chat else "1")
    done = subprocess.run(
        [sys.executable, "-m", "tests.studio.exit_probe", str(model), str(args.streams),
         str(args.max_tokens)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"the app exited {done.returncode}:\n{done.stderr[-2000:]}")
    return next(json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))


if __name__ == "__main__":
    sys.exit(main())
