"""The engine measured after its load, and the batch a stall budget asks for: the choice
without I/O, then the real llama-server with the tiny model."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backend.app.service import StudioService
from backend.llama.engine_speed import (ATTENTION_TILE, DEFAULT_BATCH, DEFAULT_UBATCH,
                                        SpeedModel, choose_batch, fit_speed,
                                        smallest_batch, user_batch)
from backend.llama.load import LoadSettings, Snapshot
from backend.llama.supervisor import Supervisor
from tests.backend.service_harness import ServiceFactory

#: A small model on a quiet CPU: 0.5 ms a prompt token, 0.01 µs more per token of depth,
#: 30 ms a step.
CPU_LIKE = SpeedModel(per_token=0.0005, per_depth=1e-8, step=0.03)
#: SmolLM2 (Q4_1, one thread) on this 2-core VM, as measured: 8 ms a prompt token at depth
#: 0, 24 ms at depth 6,000, a decode step of 60 ms.
SMOLLM2_HERE = SpeedModel(per_token=0.008, per_depth=2.7e-6, step=0.06)


def test_the_batch_is_the_largest_whose_step_at_the_end_of_the_context_fits_the_budget():
    choice = choose_batch(CPU_LIKE, budget=0.25, slots=4, context=8192)
    assert choice.batch == choice.ubatch < DEFAULT_BATCH
    assert CPU_LIKE.chunk_seconds(choice.batch, 8192 - choice.batch) <= 0.25
    bigger = choice.batch + ATTENTION_TILE
    assert CPU_LIKE.chunk_seconds(bigger, 8192 - bigger) > 0.25
    assert "250 ms stall budget" in choice.reason and not choice.user_given


def test_a_prompt_beside_the_other_slots_streams_keeps_whole_attention_tiles():
    """llama.cpp's CPU attention computes a prompt's rows 64 at a time, one at a time
    below 64: -b 32, or -b 64 beside three decoding streams (61 prompt rows), computed
    SmolLM2's prompt at depth 6,000 at a tenth of its speed."""
    for model in (CPU_LIKE, SMOLLM2_HERE, SpeedModel(0.02, 1e-5, 0.2)):
        for slots in (2, 4, 8):
            for budget in (0.05, 0.25, 1.0):
                choice = choose_batch(model, budget=budget, slots=slots, context=8192)
                assert choice.batch % ATTENTION_TILE == 0 and choice.ubatch == choice.batch \
                    or (choice.batch, choice.ubatch) == (DEFAULT_BATCH, DEFAULT_UBATCH)
                assert choice.batch - (slots - 1) >= ATTENTION_TILE


def test_an_engine_too_slow_for_the_budget_gets_whole_tiles_not_the_smallest_batch():
    """SmolLM2 here: at the end of its 8,192-token context even one tile of prompt takes
    ~2 s, so no batch meets 250 ms; a 32-token batch made each stall a little shorter and
    the prompt 0.26x as fast as the engine's default batch (bench/prefill.py)."""
    choice = choose_batch(SMOLLM2_HERE, budget=0.25, slots=4, context=8192)
    assert choice.batch == choice.ubatch == smallest_batch(4) == 2 * ATTENTION_TILE
    assert SMOLLM2_HERE.speed_share(choice.batch) >= 0.85
    assert "cannot be met" in choice.reason and "250 ms" in choice.reason


def test_an_engine_with_a_large_fixed_cost_per_step_gets_a_batch_that_keeps_its_speed():
    """An engine whose every step costs 12 ms besides 0.1 ms a prompt token (a GPU's
    launches, say), calibrated as measure_speed does (a 128-token cold chunk, one 128
    tokens deep, then decode steps): its batch keeps prefill within 15 % of its best
    speed, and its step, streams beside it, within the budget."""
    true = SpeedModel(per_token=1e-4, per_depth=0.0, step=0.012)
    cold = {"prompt_n": 128, "prompt_ms": (true.step + 128 * true.per_token) * 1000}
    deep = dict(cold, predicted_n=8, predicted_ms=8 * true.step * 1000)
    fitted = fit_speed(cold, deep, depth=512)
    assert fitted is not None
    choice = choose_batch(fitted[0], budget=0.25, slots=4, context=8192)
    assert true.speed_share(choice.batch) >= 0.85
    assert true.chunk_seconds(choice.batch, 8192 - choice.batch) <= 0.25


def test_the_calibration_fit_predicts_the_steps_it_measured():
    """A micro-batch's fixed cost is not its tokens': the fit of a chunk of 128 tokens
    at depth 0 and one at depth 512 predicts both chunks' times back."""
    true = SpeedModel(per_token=0.008, per_depth=2.7e-6, step=0.06)
    def timings(depth: int) -> dict[str, float]:
        return {"prompt_n": 128, "prompt_ms": (true.chunk_seconds(128, depth) - true.step) * 1000,
                "predicted_n": 8, "predicted_ms": 8 * true.step * 1000}
    fitted = fit_speed(timings(0), timings(512), depth=512)
    assert fitted is not None
    model, rate = fitted
    assert model.per_token == pytest.approx(true.per_token, rel=1e-6)
    assert model.per_depth == pytest.approx(true.per_depth, rel=1e-6)
    assert model.step == pytest.approx(true.step)
    assert rate == pytest.approx(128 / (true.chunk_seconds(128, 0) - true.step))


def test_a_deeper_context_or_a_tighter_budget_gets_a_smaller_batch():
    short = choose_batch(CPU_LIKE, budget=0.25, slots=4, context=2048).batch
    deep = choose_batch(CPU_LIKE, budget=0.25, slots=4, context=32768).batch
    tight = choose_batch(CPU_LIKE, budget=0.1, slots=4, context=2048).batch
    assert deep < short and tight < short


def test_a_fast_engine_keeps_its_own_batch_and_says_why():
    fast = SpeedModel(per_token=1e-5, per_depth=0.0, step=0.01)
    choice = choose_batch(fast, budget=0.25, slots=4, context=8192)
    assert (choice.batch, choice.ubatch) == (DEFAULT_BATCH, DEFAULT_UBATCH)
    assert "full batch stays within" in choice.reason


def test_one_slot_or_no_budget_keeps_the_engines_batch():
    for choice in (choose_batch(CPU_LIKE, budget=0.25, slots=1, context=8192),
                   choose_batch(CPU_LIKE, budget=0, slots=4, context=8192)):
        assert (choice.batch, choice.ubatch) == (DEFAULT_BATCH, DEFAULT_UBATCH)


def test_the_users_own_batch_wins_and_is_reported():
    assert user_batch(["-ub", "64", "--batch-size=256"]) == (256, 64)
    choice = choose_batch(CPU_LIKE, budget=0.25, slots=4, context=8192,
                          extra_args=("-b", "4096"))
    assert (choice.batch, choice.ubatch, choice.user_given) == (4096, DEFAULT_UBATCH, True)
    assert "extra arguments" in choice.reason


@pytest.fixture
async def supervisor(llama_server_binary: Path, tmp_path: Path):
    sup = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=60, stop_timeout=5)
    yield sup
    await sup.unload()


def engine_command(snapshot: Snapshot) -> list[str]:
    assert snapshot.pid is not None
    with open(f"/proc/{snapshot.pid}/cmdline", "rb") as f:
        return [arg.decode() for arg in f.read().split(b"\0") if arg]


def batch_flags(command: list[str]) -> tuple[int, int]:
    def last(flag: str, default: int) -> int:
        found = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]
        return int(found[-1]) if found else default
    return last("--batch-size", DEFAULT_BATCH), last("--ubatch-size", DEFAULT_UBATCH)


async def test_a_load_is_measured_and_its_engine_runs_with_the_batch_its_budget_chose(
        supervisor, tiny_model):
    supervisor.stall_budget = lambda: 0.05  # tight, so the tiny model's default is too big
    snapshot = await supervisor.load(LoadSettings(parallel="2", ctx_size=8192)
                                     .to_spec(str(tiny_model)))
    speed = snapshot.serving.speed
    assert speed is not None
    assert speed.prefill_tokens_per_second > 0 and speed.step_seconds > 0
    assert batch_flags(engine_command(snapshot)) == (speed.choice.batch, speed.choice.ubatch)
    assert speed.choice.batch < DEFAULT_BATCH
    assert speed.worst_step_seconds <= 0.05 \
        or speed.choice.batch == smallest_batch(2)
    assert speed.to_dict()["batch"] == speed.choice.batch


async def test_the_users_batch_in_extra_arguments_is_what_the_engine_runs(supervisor, tiny_model):
    supervisor.stall_budget = lambda: 0.05
    snapshot = await supervisor.load(LoadSettings(parallel="2", ctx_size=4096,
                                                  extra_args=("-b", "96", "-ub", "96"))
                                     .to_spec(str(tiny_model)))
    speed = snapshot.serving.speed
    assert speed is not None and speed.choice.user_given
    assert (speed.choice.batch, speed.choice.ubatch) == (96, 96)
    assert "--batch-size" not in engine_command(snapshot)  # only the user's own -b/-ub
    assert "extra arguments" in speed.to_dict()["batch_reason"]


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service()


async def test_health_and_metrics_show_the_measured_speed(service, tiny_model):
    snapshot = await service.load(LoadSettings(parallel="2", ctx_size=4096)
                                  .to_spec(str(tiny_model)))
    speed = snapshot.serving.speed
    assert speed is not None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}") as client:
        health = (await client.get("/health")).json()
        metrics = (await client.get("/metrics")).text
    engine = health["models"][0]["engines"][0]
    assert engine["speed"] == speed.to_dict() == health["speed"]
    assert engine["speed"]["prefill_tokens_per_second"] > 0
    assert "gguf_studio_engine_prefill_tokens_per_second{" in metrics
    assert "gguf_studio_engine_step_seconds{" in metrics
    line = next(l for l in metrics.splitlines()
                if l.startswith("gguf_studio_engine_step_seconds{"))
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(engine["speed"]["step_ms"] / 1000)
