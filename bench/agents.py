"""Coding agents sharing one model: through the port and directly against the engine.

N simulated agents each hold a conversation like a coding agent's: a long system prompt,
then turns of a few hundred tokens, every turn sending the whole conversation again
(streamed chat completions).  The same agents run twice per round, side by side:

- **direct**: straight at llama-server's own port (what a user gets without GGUF Studio);
- **port**: through GGUF Studio's OpenAI-compatible port, which admits by slots and KV
  tokens.

Both modes use one `gguf-studio serve` process per run with the same flags (so the engine
and its cache start equal); direct mode talks to that serve's llama-server child, found
from its command line.  Printed per mode: completed and failed turns, wall time, prompt
tokens the engine evaluated and those it took from its cache (llama-server's `timings`),
and the port ÷ direct wall-time ratio.

    .venv/bin/python bench/agents.py                      # 3 agents that do not fit together
    .venv/bin/python bench/agents.py --agents 2 --system-words 1500   # agents that fit

Targets (issue 9): zero failed turns through the port where direct fails; port wall time
≤ 1.1× direct where direct has no failures.  Not a test: nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.llama.engine import Engine  # noqa: E402
from tests.model_factory import write_tiny_model  # noqa: E402

WORDS = ("function return value error import class module test file path string list "
         "index buffer stream token parse build change commit branch merge request async "
         "await result option config server client socket thread queue lock event").split()


@dataclass
class Turn:
    ok: bool
    seconds: float
    prompt_n: int = 0
    cache_n: int = 0
    error: str = ""


@dataclass
class Run:
    mode: str
    wall: float = 0.0
    turns: list[Turn] = field(default_factory=list)

    @property
    def completed(self) -> int:
        return sum(t.ok for t in self.turns)

    @property
    def failed(self) -> int:
        return sum(not t.ok for t in self.turns)


def text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def agent(client: httpx.AsyncClient, url: str, headers: dict[str, str], index: int,
                args: argparse.Namespace, run: Run) -> None:
    rng = random.Random(index)
    messages = [{"role": "system", "content": f"You are agent {index}. " + text(args.system_words, rng)}]
    for _ in range(args.turns):
        messages.append({"role": "user", "content": text(args.turn_words, rng)})
        body = {"model": "tiny", "messages": messages, "stream": True,
                "max_tokens": args.output_tokens, "ignore_eos": True}
        started = time.perf_counter()
        reply, turn = await stream_turn(client, url, headers, body)
        turn.seconds = time.perf_counter() - started
        run.turns.append(turn)
        if turn.ok:
            messages.append({"role": "assistant", "content": reply})
        else:
            messages.pop()  # a real agent would retry the same turn; this one moves on


async def stream_turn(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                      body: dict) -> tuple[str, Turn]:
    parts: list[str] = []
    turn = Turn(ok=False, seconds=0.0)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return "", turn
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    turn.error = json.dumps(event["error"])[:200]
                    continue
                for choice in event.get("choices") or ():
                    parts.append((choice.get("delta") or {}).get("content") or "")
                timings = event.get("timings")
                if timings:
                    turn.prompt_n = timings.get("prompt_n", 0)
                    turn.cache_n = timings.get("cache_n", 0)
            turn.ok = done and not turn.error
    except httpx.HTTPError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    return "".join(parts), turn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_child(serve_pid: int) -> tuple[str, dict[str, str]]:
    """The base URL and auth header of the llama-server that `serve_pid` started."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != serve_pid:
            continue
        args = [a.decode() for a in argv]
        if "--port" in args:
            port = args[args.index("--port") + 1]
            headers = {}
            if "--api-key-file" in args:  # the random key GGUF Studio gave its engine
                key = Path(args[args.index("--api-key-file") + 1]).read_text().strip()
                headers["Authorization"] = "Bearer " + key
            return f"http://127.0.0.1:{port}", headers
    raise RuntimeError("the serve process has no llama-server child")


async def one_run(mode: str, model: Path, binary: Path, args: argparse.Namespace,
                  home: Path) -> Run:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(XDG_CONFIG_HOME=str(home / "config"), XDG_STATE_HOME=str(home / "state"),
               XDG_CACHE_HOME=str(home / "cache"), PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "backend.app.cli", "serve", "--model", str(model),
               "--port", str(port), "--parallel", args.parallel, "--ctx-size", str(args.ctx_size),
               "--llama-server", str(binary), "--threads", str(args.threads)]
    serve = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = Run(mode)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or serve.poll() is not None:
                    raise RuntimeError("the port did not become ready")
                await asyncio.sleep(0.1)
            if mode == "direct":
                base, headers = engine_child(serve.pid)
            else:
                base, headers = f"http://127.0.0.1:{port}", {}
            url = base + "/v1/chat/completions"
            started = time.perf_counter()
            await asyncio.gather(*(agent(client, url, headers, i, args, run)
                                   for i in range(args.agents)))
            run.wall = time.perf_counter() - started
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
    return run


def report(runs: list[Run]) -> None:
    print(f"{'mode':<7} {'turns ok':>8} {'failed':>6} {'wall s':>8} {'evaluated':>10} "
          f"{'cached':>8}  first error")
    for run in runs:
        evaluated = sum(t.prompt_n for t in run.turns)
        cached = sum(t.cache_n for t in run.turns)
        error = next((t.error for t in run.turns if t.error), "")
        print(f"{run.mode:<7} {run.completed:>8} {run.failed:>6} {run.wall:>8.1f} "
              f"{evaluated:>10} {cached:>8}  {error[:90]}")
    by_mode: dict[str, list[Run]] = {}
    for run in runs:
        by_mode.setdefault(run.mode, []).append(run)
    if {"direct", "port"} <= by_mode.keys():
        ratios = [p.wall / d.wall for p, d in zip(by_mode["port"], by_mode["direct"])]
        direct_failed = sum(r.failed for r in by_mode["direct"])
        port_failed = sum(r.failed for r in by_mode["port"])
        print(f"\nport ÷ direct wall time: median {statistics.median(ratios):.2f} "
              f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); failed turns: "
              f"direct {direct_failed}, port {port_failed}")


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=4500,
                   help="words of the system prompt (about 1.3 tokens each)")
    p.add_argument("--turn-words", type=int, default=250)
    p.add_argument("--output-tokens", type=int, default=300)
    p.add_argument("--ctx-size", type=int, default=16384)
    p.add_argument("--parallel", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--llama-server", type=Path)
    args = p.parse_args()

    engine = Engine()
    binary = args.llama_server or engine.resolve().chosen.path
    vocab = (await engine.source_tree_async()) / "models" / "ggml-vocab-llama-spm.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        model = write_tiny_model(home / "tiny.gguf", vocab, context_length=max(args.ctx_size, 8192))
        runs = []
        for round_ in range(args.rounds):
            for mode in (("direct", "port") if round_ % 2 == 0 else ("port", "direct")):
                run = await one_run(mode, model, binary, args, home)
                print(f"round {round_ + 1} {mode}: {run.completed} ok, {run.failed} failed, "
                      f"{run.wall:.1f} s", file=sys.stderr, flush=True)
                runs.append(run)
    print(f"{args.agents} agents × {args.turns} turns; system ≈ {args.system_words} words, "
          f"turns ≈ {args.turn_words} words, {args.output_tokens} output tokens; "
          f"--parallel {args.parallel} --ctx-size {args.ctx_size}\n")
    report(runs)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
