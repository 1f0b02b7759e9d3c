"""The GPU code path for real: the Vulkan engine on Mesa's lavapipe device.

Lavapipe is a Vulkan 1.3 device that runs on the CPU, so this machine (no GPU) still
goes through everything a GPU load does: llama.cpp's Vulkan backend, layers offloaded to
a Vulkan device, device buffers, the engine's own report of them.  It needs the Vulkan
engine, which takes long to build, so it runs only where that engine is built:

    sudo apt-get install mesa-vulkan-drivers libvulkan-dev glslc spirv-headers vulkan-tools
    gguf-studio engine build --backend vulkan

llama.cpp skips CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES names them, so the
test names lavapipe there (the app never does: a software device is slower than the CPU
engine, see accelerators.wanted).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backend.llama.accelerators import detect
from backend.llama.engine import Engine
from backend.errors import GpuLoadFailed
from backend.app.service import StudioService
from backend.settings import Settings
from backend.llama.load import LoadSettings, LoadSpec, State

ENABLE = ("build the Vulkan engine to run it: apt-get install mesa-vulkan-drivers "
          "libvulkan-dev glslc spirv-headers vulkan-tools, then "
          "`gguf-studio engine build --backend vulkan` (see README, GPU engines)")


@pytest.fixture(scope="module")
def vulkan_binary(engine: Engine) -> Path:
    binary = engine.managed_binary_for("vulkan")
    if binary is None:
        pytest.skip(f"no Vulkan engine built; {ENABLE}")
    return binary


@pytest.fixture(scope="module")
def software_vulkan_index() -> str:
    devices = detect().get("vulkan").devices
    for index, device in enumerate(devices):
        if device.kind == "cpu":
            return str(index)
    pytest.skip("no software Vulkan device (lavapipe): apt-get install mesa-vulkan-drivers vulkan-tools")


@pytest.fixture
async def vulkan_service(tmp_path: Path, vulkan_binary: Path, software_vulkan_index: str,
                         monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", software_vulkan_index)
    settings = Settings(port=0, llama_server=str(vulkan_binary), load_timeout=120)
    service = StudioService(settings, log_dir=tmp_path / "logs")
    await service.start_gateway()
    yield service
    await service.close()


async def test_a_default_load_puts_the_layers_on_the_vulkan_device_and_answers_chats(
        vulkan_service: StudioService, tiny_model: Path):
    snapshot = await vulkan_service.load(LoadSpec(str(tiny_model)))  # default settings
    assert snapshot.state is State.READY
    report = snapshot.engine
    assert report is not None, "the engine printed no load report"
    print("engine report:", report.summary())
    assert report.backend == "vulkan"
    assert report.layers_total and report.layers_offloaded == report.layers_total
    (device,) = report.gpu_devices
    assert device.name == "Vulkan0" and "llvmpipe" in device.description
    assert device.model_mib > 0 and device.kv_mib > 0
    assert snapshot.serving is not None and snapshot.serving.context_length is not None
    assert report.context_size and report.context_size >= snapshot.serving.context_length

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{vulkan_service.gateway_port}",
                                 timeout=120) as client:
        health = (await client.get("/health")).json()
        assert health["engine"]["backend"] == "vulkan"
        assert health["engine"]["layers_offloaded"] == report.layers_total
        reply = await client.post("/v1/chat/completions", json={
            "model": snapshot.model_id, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hello"}]})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] > 0
        metrics = (await client.get("/metrics")).text
        assert f"gguf_studio_engine_layers_offloaded {float(report.layers_total)}" in metrics
        assert 'gguf_studio_engine_device_memory_mib{backend="vulkan",device="Vulkan0"}' in metrics


async def test_none_keeps_every_layer_off_the_vulkan_device(
        vulkan_service: StudioService, tiny_model: Path):
    snapshot = await vulkan_service.load(LoadSettings(n_gpu_layers="none").to_spec(str(tiny_model)))
    report = snapshot.engine
    assert report is not None
    print("engine report:", report.summary())
    assert report.backend == "cpu" and not report.on_gpu
    assert report.gpu_devices == ()


async def test_a_load_the_vulkan_device_cannot_hold_fails_readably_and_retries_on_the_cpu(
        vulkan_service: StudioService, tiny_model: Path):
    # A context of 1.5 M tokens makes each layer's K cache 192 MiB, more than lavapipe's
    # largest storage buffer (128 MiB): llama.cpp aborts while placing it on the device,
    # as it does on a real GPU given a context too large for it.  On the CPU it loads
    # (about 1 GB of memory for the cache).
    too_big = LoadSettings(parallel="1", ctx_size=1_572_864).to_spec(str(tiny_model))
    with pytest.raises(GpuLoadFailed) as failed:
        await vulkan_service.load(too_big)
    print("failure:", failed.value)
    assert "context is too large for the device" in str(failed.value)
    assert vulkan_service.snapshot().state is State.FAILED
    assert vulkan_service.snapshot().cpu_retry_offered

    snapshot = await vulkan_service.retry_on_cpu()
    assert snapshot.state is State.READY and not snapshot.cpu_retry_offered
    assert snapshot.engine is not None
    print("after retry:", snapshot.engine.summary())
    assert snapshot.engine.backend == "cpu" and not snapshot.engine.on_gpu
    assert snapshot.engine.context_size == 1_572_864
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{vulkan_service.gateway_port}",
                                 timeout=120) as client:
        reply = await client.post("/v1/chat/completions", json={
            "model": snapshot.model_id, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]})
        assert reply.status_code == 200, reply.text
