"""Will it fit: weights + KV cache + working space against RAM and GPU memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from backend.llama.load import LoadSettings
from backend.llama.supervisor import Supervisor
from backend.models.gguf_info import read_model_info
from backend.models.fit import (
    FITS_GPU,
    FITS_RAM,
    TOO_BIG,
    CacheSettings,
    KvShape,
    MachineMemory,
    context_memory,
    estimate_fit,
    machine_memory,
)
from tests.model_factory import EMBEDDING_LENGTH, HEAD_COUNT, HEAD_COUNT_KV, LAYER_COUNT
from tests.not_none import not_none

GB = 10**9
MIB = 1 << 20


def test_the_kv_cache_comes_from_the_gguf_header(tiny_model):
    info = read_model_info(tiny_model)
    fit = estimate_fit(info.file_size, MachineMemory(16 * GB), context=4096, info=info)
    head_width = EMBEDDING_LENGTH // HEAD_COUNT
    # layers x KV heads x (key + value widths) x 2 bytes (f16): 2 x 4 x 32 x 2
    sized = not_none(fit.context_memory)
    assert sized.bytes_per_token == LAYER_COUNT * HEAD_COUNT_KV * (head_width + head_width) * 2 == 512
    assert fit.basis == "header"
    assert fit.kv_bytes == sized.bytes_per_token * 4096
    assert fit.total_bytes == info.file_size + fit.kv_bytes + fit.margin_bytes
    assert "for 4,096 tokens of context" in fit.details()


def test_a_longer_context_needs_more_memory_and_can_tip_the_badge():
    memory = MachineMemory(ram_bytes=16 * GB)
    repo = {"total": 8 * GB}  # parameters, as the repository reports them
    short = estimate_fit(5 * GB, memory, context=8192, repo_metadata=repo)
    long = estimate_fit(5 * GB, memory, context=131072, repo_metadata=repo)
    assert short.basis == "repository" and "about" in short.details()
    assert long.kv_bytes == 16 * short.kv_bytes
    assert (short.verdict, long.verdict) == (FITS_RAM, TOO_BIG)


def test_the_badge_prefers_the_gpu_when_its_memory_holds_the_model():
    repo = {"total": 8 * GB}
    assert estimate_fit(5 * GB, MachineMemory(32 * GB, (24 * GB,)), repo_metadata=repo).verdict == FITS_GPU
    # Two GPUs together: llama.cpp splits the layers between them.
    assert estimate_fit(14 * GB, MachineMemory(8 * GB, (8 * GB, 8 * GB)), context=1024).verdict == FITS_GPU
    small_gpu = estimate_fit(5 * GB, MachineMemory(32 * GB, (4 * GB,)), repo_metadata=repo)
    assert small_gpu.verdict == FITS_RAM
    assert "3.7 GiB GPU" in small_gpu.details() and "29.8 GiB RAM" in small_gpu.details()


def test_the_numbers_on_hover_name_the_gpu():
    memory = MachineMemory(32 * GB, (24 * GB,), ("NVIDIA GeForce RTX 4090",))
    fit = estimate_fit(5 * GB, memory)
    assert fit.verdict == FITS_GPU
    assert "22.4 GiB (NVIDIA GeForce RTX 4090) GPU memory" in fit.details()
    assert machine_memory([("NVIDIA GeForce RTX 4090", 24 * GB)]).gpu_names == ("NVIDIA GeForce RTX 4090",)


def test_without_a_header_or_parameter_count_the_context_is_said_to_be_unknown():
    fit = estimate_fit(2 * GB, MachineMemory(16 * GB))
    assert fit.basis == "size" and fit.kv_bytes == 0
    assert "context memory unknown" in fit.details()


def test_this_machine_reports_its_ram():
    memory = machine_memory()
    assert memory.ram_bytes > 256 * 1024 * 1024
    assert memory.gpu_vram_bytes == ()


# --- the estimate against what the engine allocates, family by family ----------------------


@pytest.fixture
def family_model(request: pytest.FixtureRequest) -> Path:
    """The model fixture named by the test's parameter (set up before the test's loop)."""
    model: Path = request.getfixturevalue(request.param)
    return model


FAMILIES = ["tiny_model", "smollm2_model", "gemma3_model", "hybrid_model", "swa_moe_model"]


@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("family_model", FAMILIES, indirect=True)
async def test_the_estimate_is_what_the_engine_allocates_for_each_family(
        llama_server_binary, tmp_path, family_model, context):
    # Two slots, each its own stream: the window and the state count per slot.  At the
    # model's trained context when it is shorter (SmolLM2 and the tiny llama: 8,192).
    context = min(context, not_none(read_model_info(family_model).context_length))
    await assert_estimate_is_allocated(llama_server_binary, tmp_path, family_model,
                                       LoadSettings(ctx_size=context, parallel="2"))


@pytest.mark.parametrize("extra_args", [("--swa-full",), ("-ctk", "q8_0", "-ctv", "q8_0", "--kv-unified")])
async def test_the_estimate_follows_the_engine_flags_that_size_the_cache(
        llama_server_binary, tmp_path, gemma3_model, extra_args):
    await assert_estimate_is_allocated(llama_server_binary, tmp_path, gemma3_model, LoadSettings(
        ctx_size=8192, parallel="2", extra_args=extra_args))


async def assert_estimate_is_allocated(binary: Path, log_dir: Path, model: Path,
                                       settings: LoadSettings) -> None:
    """Load `model` with `settings` and compare the estimate with the KV cache and state
    the engine reports it allocated (its log's "KV buffer" and "RS buffer" lines)."""
    info = read_model_info(model)
    layout = not_none(info.memory)
    supervisor = Supervisor(binary, log_dir, load_timeout=120, stop_timeout=5)
    try:
        engine = await supervisor.load(settings.to_spec(str(model)))
    finally:
        await supervisor.unload()
    report, serving = not_none(engine.engine), not_none(engine.serving)
    kv_mib = sum(device.kv_mib for device in report.devices)
    state_mib = sum(device.state_mib for device in report.devices)
    cache = not_none(CacheSettings.of_load(settings.ctx_size, settings.parallel, info.context_length,
                                           settings.extra_args))
    # The engine may restart with a smaller micro-batch once its speed is measured; a
    # sliding window's cache holds one micro-batch beyond the window.
    if serving.speed is not None:
        cache = dataclasses.replace(cache, ubatch=serving.speed.choice.ubatch)
    estimate = context_memory(layout, cache)
    assert estimate.full_bytes + estimate.sliding_bytes == pytest.approx(kv_mib * MIB, rel=0.1)
    assert estimate.recurrent_bytes == pytest.approx(state_mib * MIB, rel=0.1)
    assert bool(estimate.sliding_bytes) == bool(layout.sliding_layers)


def test_the_load_settings_give_the_engines_cache_flags():
    split = not_none(CacheSettings.of_load(32768, "4", 8192, ("-ub", "256", "--swa-full", "-ctk", "q8_0")))
    assert (split.context, split.slots, split.unified) == (32768, 4, False)
    assert (split.ubatch, split.swa_full, split.type_k, split.type_v) == (256, True, "q8_0", "f16")
    auto = not_none(CacheSettings.of_load(0, "auto", 8192, ("-ctxcp", "8")))
    assert (auto.context, auto.slots, auto.unified, auto.checkpoints) == (8192, 4, True, 8)
    assert not_none(CacheSettings.of_load(0, "2", 8192)).checkpoints == 4  # as the app starts it
    # The model's own context on a split cache: each slot gets the trained context.
    assert not_none(CacheSettings.of_load(0, "2", 8192)).context == 16384
    assert CacheSettings.of_load(0, "2", None) is None


def test_a_sliding_window_model_needs_far_less_than_every_layer_full(gemma3_model):
    info = read_model_info(gemma3_model)
    fit = estimate_fit(info.file_size, MachineMemory(16 * GB), context=32768, info=info)
    sized = not_none(fit.context_memory)
    # 3 global layers x 1 KV head x (256 + 256) x f16 a token; 15 sliding layers hold their
    # 512-token window and a 512-token micro-batch.
    assert sized.full_bytes == 3 * 512 * 2 * 32768 == 96 * MIB
    assert sized.sliding_bytes == 15 * 512 * 2 * 1024 == 15 * MIB
    assert "15 sliding-window layers (512 tokens; 1,024 cells)" in fit.details()
    # Context checkpoints (a slot's window: 512 cells of the 15 sliding layers, 7.5 MiB as
    # the engine logs them; at most 4 a slot, as the app starts engines) are said, not
    # counted.
    assert sized.checkpoint_bytes == 4 * 15 * 512 * 2 * 512 and fit.kv_bytes == 111 * MIB


def test_a_slots_shape_counts_the_full_layers_per_token_and_the_window_per_slot(gemma3_model):
    shape = not_none(KvShape.from_model_info(read_model_info(gemma3_model)))
    assert shape.bytes_per_token == 3 * 512 * 2  # the 3 global layers, f16
    assert shape.bytes_per_sequence == 15 * 512 * 2 * 1024  # the window and a micro-batch
