"""The engine measured after its load, and the batch a stall budget asks for: the choice
without I/O, then the real llama-server with the tiny model."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backend.app.service import StudioService
from backend.llama.engine_speed import (DEFAULT_BATCH, DEFAULT_UBATCH, MIN_BATCH, SpeedModel,
                                        choose_batch, user_batch)
from backend.llama.load import LoadSettings, Snapshot
from backend.llama.supervisor import Supervisor
from tests.backend.service_harness import ServiceFactory

#: An engine like SmolLM2 on this CPU: 2 ms a prompt token, 0.1 µs more per token of
#: depth, 30 ms a step.
CPU_LIKE = SpeedModel(per_token=0.002, per_depth=1e-7, step=0.03)


def test_the_batch_is_the_largest_whose_step_at_the_end_of_the_context_fits_the_budget():
    choice = choose_batch(CPU_LIKE, budget=0.25, slots=4, context=8192)
    assert choice.batch == choice.ubatch < DEFAULT_BATCH
    assert CPU_LIKE.chunk_seconds(choice.batch, 8192 - choice.batch) <= 0.25
    bigger = choice.batch + MIN_BATCH
    assert CPU_LIKE.chunk_seconds(bigger, 8192 - bigger) > 0.25
    assert "250 ms stall budget" in choice.reason and not choice.user_given


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
    assert speed.worst_step_seconds <= 0.05 or speed.choice.batch == MIN_BATCH
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
