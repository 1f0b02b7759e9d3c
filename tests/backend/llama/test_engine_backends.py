"""Engines per backend: their build keys, what a build needs, and which one a load uses."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from backend.llama.accelerators import detect
from backend.llama.engine import (RPC_SERVER_NAME, BuildKey, Engine, backend_cmake_args,
                                  engine_patches, plan_build)
from backend.llama.patches import LLAMA_CPP_PATCHES
from backend.errors import BuildToolMissing, EngineNotFound
from tests.backend.llama.test_accelerators import (
    NVIDIA_SMI, VULKANINFO_DISCRETE, machine, vulkan_dev_files,
)
from tests.backend.llama.test_engine import fake_executable
from tests.not_none import not_none


def plan(backend: str, probes, tmp_path: Path):
    return asyncio.run(plan_build(backend, tmp_path, accelerators=detect(probes)))


def test_each_backend_has_its_own_key_and_the_cpu_key_before_rpc_is_unchanged():
    before_rpc = BuildKey(rpc=False, patches=())
    assert before_rpc.name == "llama.cpp-0.3.36-788912df729d"  # built before GPU backends and RPC
    cpu = BuildKey()
    assert cpu.name.startswith("llama.cpp-0.3.36-") and cpu.name != before_rpc.name
    vulkan = BuildKey(extra_cmake_args=("-DGGML_VULKAN=ON",), backend="vulkan",
                      toolkit=("vulkan-headers=1.4.309",))
    assert vulkan.name.startswith("llama.cpp-0.3.36-vulkan-")
    other_headers = BuildKey(extra_cmake_args=("-DGGML_VULKAN=ON",), backend="vulkan",
                             toolkit=("vulkan-headers=1.4.321",))
    assert len({cpu.name, vulkan.name, other_headers.name}) == 3
    assert "-DGGML_RPC=ON" in cpu.cmake_args and "-DGGML_RPC=ON" in vulkan.cmake_args


def test_the_cuda_plan_points_cmake_at_the_toolkit_without_putting_paths_in_the_key(tmp_path):
    files = {"/usr/local/cuda/bin/nvcc": "", "/usr/local/cuda/include/cublas_v2.h": "",
             "/usr/lib/x86_64-linux-gnu/libcuda.so": ""}
    probes = machine(tools=["nvidia-smi"], files=files, outputs={
        "nvidia-smi": NVIDIA_SMI, "nvcc": "Cuda compilation tools, release 12.4, V12.4.131"})
    cuda = plan("cuda", probes, tmp_path)
    assert cuda.key.extra_cmake_args == ("-DGGML_CUDA=ON",)
    assert cuda.key.toolkit == ("nvcc=12.4",)
    assert "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc" in cuda.machine_args
    assert "/usr/local" not in cuda.key.name


def test_building_without_the_toolkit_fails_first_with_the_install_line(tmp_path):
    probes = machine(tools=["nvidia-smi"], outputs={"nvidia-smi": NVIDIA_SMI})
    with pytest.raises(BuildToolMissing, match="Install: pip install nvidia-cuda-nvcc"):
        plan("cuda", probes, tmp_path)
    with pytest.raises(BuildToolMissing, match="Metal exists only on macOS"):
        plan("metal", probes, tmp_path)


def test_the_cpu_engine_on_macos_leaves_metal_out():
    assert backend_cmake_args("cpu", "Darwin") == ("-DGGML_METAL=OFF",)
    assert backend_cmake_args("cpu", "Linux") == ()
    assert backend_cmake_args("metal", "Darwin") == ("-DGGML_METAL=ON",)


def test_a_machine_with_a_gpu_loads_with_its_engine_and_falls_back_to_the_cpu_one(tmp_path):
    engine = Engine(data_dir=tmp_path / "data")
    cpu = fake_executable(engine.managed_binary())
    environ = {"PATH": str(tmp_path / "empty")}
    wanted = detect(machine(tools=["vulkaninfo", "glslc"], files=vulkan_dev_files(),
                            outputs={"vulkaninfo": VULKANINFO_DISCRETE})).wanted()
    assert wanted == ["vulkan", "cpu"]

    before = engine.resolve(None, environ, backends=wanted)
    assert not_none(before.chosen).path == cpu
    assert any("engine build --backend vulkan" in line for line in before.describe())

    key = BuildKey(extra_cmake_args=("-DGGML_VULKAN=ON",), backend="vulkan", toolkit=("x",))
    vulkan = fake_executable(engine.managed_binary(key))
    after = engine.resolve(None, environ, backends=wanted)
    assert not_none(after.chosen).path == vulkan and not_none(after.chosen).source == "managed vulkan"
    assert engine.installed_backends() == {"cpu": cpu, "vulkan": vulkan}
    # A machine without the GPU keeps using the CPU engine even with both installed.
    assert not_none(engine.resolve(None, environ, backends=["cpu"]).chosen).path == cpu


def test_an_engine_from_before_rpc_serves_until_one_with_rpc_is_built(tmp_path):
    engine = Engine(data_dir=tmp_path / "data")
    environ = {"PATH": str(tmp_path / "empty")}
    old = fake_executable(engine.managed_binary(BuildKey(rpc=False, patches=())))
    chosen = not_none(engine.resolve(None, environ, backends=["cpu"]).chosen)
    assert chosen.path == old and "before engines had RPC" in chosen.reason
    assert "gguf-studio engine build" in chosen.reason
    with pytest.raises(EngineNotFound, match="built before GGUF Studio's engines had RPC"):
        engine.rpc_server(backends=["cpu"])

    new = fake_executable(engine.managed_binary())
    rpc_server = fake_executable(new.parent / RPC_SERVER_NAME)
    record_patches(new)
    chosen = not_none(engine.resolve(None, environ, backends=["cpu"]).chosen)
    assert chosen.path == new and chosen.reason == "built by GGUF Studio"
    assert engine.rpc_server(backends=["cpu"]) == rpc_server


def test_an_engine_from_before_our_patches_serves_until_one_with_them_is_built(tmp_path):
    engine = Engine(data_dir=tmp_path / "data")
    environ = {"PATH": str(tmp_path / "empty")}
    before = fake_executable(engine.managed_binary(BuildKey(patches=())))
    fake_executable(before.parent / RPC_SERVER_NAME)
    chosen = not_none(engine.resolve(None, environ, backends=["cpu"]).chosen)
    assert chosen.path == before and "before its engine patches" in chosen.reason
    assert "gguf-studio engine build" in chosen.reason
    assert engine_patches(before) == ()

    patched = fake_executable(engine.managed_binary())
    fake_executable(patched.parent / RPC_SERVER_NAME)
    record_patches(patched)
    chosen = not_none(engine.resolve(None, environ, backends=["cpu"]).chosen)
    assert chosen.path == patched and chosen.reason == "built by GGUF Studio"
    assert engine_patches(patched) == tuple(p.name for p in LLAMA_CPP_PATCHES)
    assert BuildKey().name != BuildKey(patches=()).name
    # The key of the engines from before the patches is what it always was.
    assert BuildKey(patches=()).name == "llama.cpp-0.3.36-6352d08e3128"


def record_patches(binary: Path) -> None:
    """What a build writes beside its binary: the patches it applied."""
    (binary.parent / "engine.json").write_text(json.dumps(
        {"patches": [p.name for p in LLAMA_CPP_PATCHES]}))


def test_a_gpu_engine_with_rpc_wins_over_a_newer_one_from_before(tmp_path):
    engine = Engine(data_dir=tmp_path / "data")
    flags = ("-DGGML_VULKAN=ON",)
    with_rpc = fake_executable(engine.managed_binary(
        BuildKey(extra_cmake_args=flags, backend="vulkan", toolkit=("a",))))
    fake_executable(with_rpc.parent / RPC_SERVER_NAME)
    older_kind = fake_executable(engine.managed_binary(
        BuildKey(extra_cmake_args=flags, backend="vulkan", toolkit=("b",), rpc=False)))
    os.utime(with_rpc, (1, 1))  # the one from before RPC is the newer file
    assert older_kind.stat().st_mtime > with_rpc.stat().st_mtime
    assert engine.managed_binary_for("vulkan") == with_rpc
