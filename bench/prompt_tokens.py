"""What counting prompt tokens before admission costs, next to what the engine spends.

    python bench/prompt_tokens.py            # about a minute on 2 shared cores
    python bench/prompt_tokens.py --quick    # fewer repetitions

Starts the managed llama-server (one slot, 32,768-token context, one compute thread)
with the tiny random model of the tests (`tests/model_factory.py`, the llama
SentencePiece vocabulary), and measures, in one run:

1. a short chat request (one user message) whose byte bound proves it fits: the
   counter never asks the engine (µs per request, pure Python);
2. the same short request counted by the engine (its counting route, one loopback
   HTTP round trip): ms per request, next to the engine's own time to first token for
   that request (a real one-token completion);
3. a ~20,000-token chat prompt counted by the engine: ms per request, next to the
   engine's prompt evaluation time for it (`timings.prompt_ms` of a real one-token
   completion; the tiny model evaluates prompts far faster than any real one, so the
   real ratio is smaller still).

Only loopback addresses are used; the engine started here is ended on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.llama.engine import Engine  # noqa: E402
from backend.admission.prompt_tokens import PromptCounter  # noqa: E402
from backend.port.tokenizer_client import HttpEngineTokenizer  # noqa: E402
from backend.llama.supervisor import pick_free_port  # noqa: E402
from tests.model_factory import write_tiny_model  # noqa: E402

CHAT = "/v1/chat/completions"
CONTEXT = 32_768


def short_body() -> dict:
    return {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": "Write a haiku about the sea."}]}


def long_body(words: int) -> dict:
    text = " ".join(f"item{i % 997} value{i % 31}" for i in range(words))
    return {"messages": [{"role": "system", "content": "You are a careful coding agent."},
                         {"role": "user", "content": text}]}


async def timed(repeat: int, action) -> list[float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        await action()
        times.append(time.perf_counter() - started)
    return times


async def engine_run(url: str, body: dict) -> tuple[float, dict]:
    """Wall time of a real one-token completion, and its timings."""
    async with httpx.AsyncClient(timeout=300) as client:
        started = time.perf_counter()
        response = await client.post(url + CHAT, json=dict(body, max_tokens=1,
                                                           cache_prompt=False))
        elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json()["timings"]


async def measure(url: str, quick: bool) -> None:
    tokenizer = HttpEngineTokenizer(url)
    counter = PromptCounter(tokenizer)
    short = short_body()
    short_bytes = len(json.dumps(short).encode())

    # Scale the long prompt to ~20,000 tokens with the engine's own count.
    words = 6_000
    probe = await counter.count(CHAT, long_body(words), 0)
    words = int(words * 20_000 / probe.tokens)
    long = long_body(words)
    long_bytes = len(json.dumps(long).encode())

    await counter.count(CHAT, short, short_bytes, fits_below=8_192)  # measures the template
    n_short = 200 if quick else 2_000
    bound = await timed(n_short, lambda: counter.count(CHAT, short, short_bytes,
                                                       fits_below=8_192))
    n_engine = 30 if quick else 200
    counted_short = await timed(n_engine, lambda: counter.count(CHAT, short, short_bytes))
    n_long = 5 if quick else 20
    counted_long = await timed(n_long, lambda: counter.count(CHAT, long, long_bytes))
    long_tokens = (await counter.count(CHAT, long, long_bytes)).tokens
    short_tokens = (await counter.count(CHAT, short, short_bytes)).tokens
    short_bound = (await counter.count(CHAT, short, short_bytes, fits_below=8_192)).tokens

    short_runs = [await engine_run(url, short) for _ in range(5 if quick else 20)]
    long_runs = [await engine_run(url, long) for _ in range(2 if quick else 3)]
    await tokenizer.aclose()

    def p50(values: list[float]) -> float:
        return statistics.median(values)

    short_ttft = p50([wall for wall, _ in short_runs])
    long_prefill = p50([t["prompt_ms"] / 1000 for _, t in long_runs])
    print(f"template fixed part: {counter.template_base} tokens")
    print(f"short request: {short_bytes} bytes, {short_tokens} tokens, bound {short_bound}")
    print(f"long request: {long_bytes} bytes, {long_tokens} tokens")
    print()
    print(f"{'case':<44}{'p50':>12}{'p90':>12}{'engine work':>14}{'ratio':>8}")
    rows = [
        ("short, byte bound (no engine call)", bound, short_ttft),
        ("short, counted by the engine", counted_short, short_ttft),
        (f"{long_tokens:,} tokens, counted by the engine", counted_long, long_prefill),
    ]
    for name, times, reference in rows:
        q90 = statistics.quantiles(times, n=10)[-1] if len(times) >= 10 else max(times)
        print(f"{name:<44}{_fmt(p50(times)):>12}{_fmt(q90):>12}{_fmt(reference):>14}"
              f"{p50(times) / reference:>8.3f}")
    print()
    print("engine work: short = the engine's time to answer a one-token completion of the "
          "same request; long = its prompt evaluation (timings.prompt_ms). ratio = p50 / "
          "engine work.")


def _fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    engine = Engine()
    chosen = engine.resolve().chosen
    if chosen is None:
        print("no llama-server: run scripts/setup first", file=sys.stderr)
        return 1
    vocab = engine.source_tree() / "models" / "ggml-vocab-llama-spm.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny.gguf", vocab, context_length=CONTEXT)
        port = pick_free_port()
        url = f"http://127.0.0.1:{port}"
        child = subprocess.Popen(
            [str(chosen.path), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
             "-np", "1", "-c", str(CONTEXT), "--jinja", "--no-webui", "-t", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while True:
                if child.poll() is not None:
                    print("llama-server exited during load", file=sys.stderr)
                    return 1
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    print("llama-server did not become healthy", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            asyncio.run(measure(url, args.quick))
        finally:
            child.terminate()
            child.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
