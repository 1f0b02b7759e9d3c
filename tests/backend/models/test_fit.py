"""Will it fit: weights + KV cache + working space against RAM and GPU memory."""

from __future__ import annotations

from backend.models.gguf_info import read_model_info
from backend.models.fit import (
    FITS_GPU,
    FITS_RAM,
    TOO_BIG,
    KvShape,
    MachineMemory,
    estimate_fit,
    machine_memory,
)
from tests.model_factory import EMBEDDING_LENGTH, HEAD_COUNT, HEAD_COUNT_KV, LAYER_COUNT
from tests.not_none import not_none

GB = 10**9


def test_the_kv_cache_comes_from_the_gguf_header(tiny_model):
    info = read_model_info(tiny_model)
    shape = not_none(KvShape.from_model_info(info))
    head_width = EMBEDDING_LENGTH // HEAD_COUNT
    # layers x KV heads x (key + value widths) x 2 bytes (f16): 2 x 4 x 32 x 2
    assert shape.bytes_per_token == LAYER_COUNT * HEAD_COUNT_KV * (head_width + head_width) * 2 == 512
    fit = estimate_fit(info.file_size, MachineMemory(16 * GB), context=4096, info=info)
    assert fit.basis == "header"
    assert fit.kv_bytes == shape.bytes_per_token * 4096
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
    assert "4.0 GB GPU" in small_gpu.details() and "32.0 GB RAM" in small_gpu.details()


def test_the_numbers_on_hover_name_the_gpu():
    memory = MachineMemory(32 * GB, (24 * GB,), ("NVIDIA GeForce RTX 4090",))
    fit = estimate_fit(5 * GB, memory)
    assert fit.verdict == FITS_GPU
    assert "24.0 GB (NVIDIA GeForce RTX 4090) GPU memory" in fit.details()
    assert machine_memory([("NVIDIA GeForce RTX 4090", 24 * GB)]).gpu_names == ("NVIDIA GeForce RTX 4090",)


def test_without_a_header_or_parameter_count_the_context_is_said_to_be_unknown():
    fit = estimate_fit(2 * GB, MachineMemory(16 * GB))
    assert fit.basis == "size" and fit.kv_bytes == 0
    assert "context memory unknown" in fit.details()


def test_this_machine_reports_its_ram():
    memory = machine_memory()
    assert memory.ram_bytes > 256 * 1024 * 1024
    assert memory.gpu_vram_bytes == ()
