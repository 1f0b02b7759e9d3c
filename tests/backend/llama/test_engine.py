"""Finding and building llama-server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backend.llama.engine import LLAMA_CPP_PYTHON_VERSION, BuildKey, BuildProgress, Engine
from backend.errors import EngineBuildFailed, EngineNotFound
from backend.llama.rpc_worker import RpcProtocol, protocol_of_engine
from tests.not_none import not_none


def fake_executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def empty_engine(tmp_path: Path) -> Engine:
    return Engine(data_dir=tmp_path / "data")


def test_resolution_prefers_explicit_then_environment_then_managed_then_path(tmp_path, empty_engine):
    explicit = fake_executable(tmp_path / "a" / "llama-server")
    from_env = fake_executable(tmp_path / "b" / "llama-server")
    on_path = fake_executable(tmp_path / "c" / "llama-server")
    fake_executable(empty_engine.managed_binary())
    environ = {"GGUF_STUDIO_LLAMA_SERVER": str(from_env), "PATH": str(on_path.parent)}

    assert empty_engine.resolve(explicit, environ).chosen.source == "explicit"
    assert empty_engine.resolve(None, environ).chosen.path == from_env
    assert empty_engine.resolve(None, {"PATH": str(on_path.parent)}).chosen.source == "managed"
    os.remove(empty_engine.managed_binary())
    assert empty_engine.resolve(None, {"PATH": str(on_path.parent)}).chosen.path == on_path


def test_status_says_why_each_candidate_was_not_used(tmp_path, empty_engine):
    missing = tmp_path / "nope" / "llama-server"
    resolution = empty_engine.resolve(missing, {"PATH": str(tmp_path / "empty")})
    lines = resolution.describe()
    assert resolution.chosen is None
    assert "does not exist" in lines[0]
    assert "not set" in lines[1]
    assert "not built yet" in lines[2]
    assert "none on PATH" in lines[3]
    with pytest.raises(EngineNotFound, match="gguf-studio engine build"):
        resolution.path


def test_a_later_usable_candidate_is_marked_as_not_used(tmp_path, empty_engine):
    explicit = fake_executable(tmp_path / "a" / "llama-server")
    on_path = fake_executable(tmp_path / "c" / "llama-server")
    lines = empty_engine.resolve(explicit, {"PATH": str(on_path.parent)}).describe()
    assert lines[0].startswith("->")
    assert "an earlier one wins" in lines[3]


def test_build_key_changes_with_flags_and_not_otherwise():
    assert BuildKey().name == BuildKey().name
    assert BuildKey(extra_cmake_args=("-DGGML_CUDA=ON",)).name != BuildKey().name
    assert BuildKey(extra_cmake_args=("-DGGML_VULKAN=ON",)).name != \
        BuildKey(extra_cmake_args=("-DGGML_CUDA=ON",)).name


async def test_second_build_with_the_same_key_is_a_no_op(engine, llama_server_binary):
    if not engine.installed():
        pytest.skip("the managed engine is not the one in use (GGUF_STUDIO_LLAMA_SERVER set)")
    before = engine.managed_binary().stat().st_mtime_ns
    events: list[BuildProgress] = []
    path = await engine.build(progress=events.append)
    assert path == engine.managed_binary()
    assert [e.phase for e in events] == ["done"]
    assert "already built" in events[0].line
    assert engine.managed_binary().stat().st_mtime_ns == before


async def test_failed_build_reports_the_log_tail_and_installs_nothing(engine, source_tree, tmp_path):
    # Unpatched: a patched copy would be made beside the shared sources.
    scratch = Engine(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache", patches=())
    # Share the unpacked sources, not the build trees.
    (scratch.cache_dir / "src").mkdir(parents=True)
    (scratch.cache_dir / "src" / source_tree.parents[1].name).symlink_to(source_tree.parents[1])
    events: list[BuildProgress] = []
    with pytest.raises(EngineBuildFailed) as caught:
        await scratch.build(["-DCMAKE_C_COMPILER=/nonexistent/cc"], progress=events.append)
    assert "Configuring llama.cpp failed" in str(caught.value)
    assert "nonexistent" in caught.value.log_tail
    assert not scratch.engines_dir.exists() or list(scratch.engines_dir.iterdir()) == []
    assert events[0].phase == "configure"


async def test_interrupted_build_leaves_no_half_engine(engine, source_tree, tmp_path):
    scratch = Engine(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache", patches=())
    (scratch.cache_dir / "src").mkdir(parents=True)
    (scratch.cache_dir / "src" / source_tree.parents[1].name).symlink_to(source_tree.parents[1])
    compiling = asyncio.Event()
    events: list[BuildProgress] = []

    def on_progress(p: BuildProgress) -> None:
        events.append(p)
        if p.phase == "compile":
            compiling.set()

    build = asyncio.create_task(scratch.build(["-DGGML_NATIVE=OFF"], progress=on_progress, jobs=1))
    await asyncio.wait_for(compiling.wait(), 300)
    build.cancel()
    with pytest.raises(asyncio.CancelledError):
        await build
    assert not scratch.installed(BuildKey(extra_cmake_args=("-DGGML_NATIVE=OFF",), patches=()))
    leftovers = list(scratch.engines_dir.iterdir()) if scratch.engines_dir.exists() else []
    assert leftovers == []
    # Progress is a percentage parsed from the build's own output.
    assert 0 < [e for e in events if e.phase == "compile"][0].percent < 100


def test_build_progress_is_parsed_from_ninja_output():
    from backend.llama.engine import _NINJA_PROGRESS
    m = not_none(_NINJA_PROGRESS.match("[103/206] Building CXX object src/llama.cpp.o"))
    assert (int(m.group(1)), int(m.group(2))) == (103, 206)


def test_engine_status_command_names_the_engine_in_use(llama_server_binary):
    out = subprocess.run([sys.executable, "-m", "backend.app.cli", "engine", "status",
                          "--llama-server", str(llama_server_binary)],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0].startswith(f"-> explicit: {llama_server_binary}")
    assert "accelerators (backend, usable here, why):" in out
    assert "best engine this machine can build:" in out


def test_engine_status_json_lists_candidates_and_every_backend_with_a_reason(llama_server_binary):
    out = subprocess.run([sys.executable, "-m", "backend.app.cli", "engine", "status", "--json",
                          "--llama-server", str(llama_server_binary)],
                         capture_output=True, text=True, check=True).stdout
    status = json.loads(out)
    assert status["chosen"] == {"source": "explicit", "path": str(llama_server_binary)}
    backends = {b["backend"]: b for b in status["accelerators"]["backends"]}
    assert set(backends) == {"cpu", "cuda", "hip", "metal", "vulkan"}
    assert all(b["reason"] for b in backends.values())
    assert status["accelerators"]["best_buildable"] in backends


async def test_sources_that_fail_their_hash_check_are_refused_and_not_kept(tmp_path, monkeypatch):
    """The real registry fetch, with a pinned hash that cannot match."""
    import backend.llama.engine as engine_module
    monkeypatch.setattr(engine_module, "LLAMA_CPP_PYTHON_SDIST_SHA256", "0" * 64)
    scratch = Engine(data_dir=tmp_path / "data")
    with pytest.raises(EngineBuildFailed, match="failed their hash check"):
        await scratch.source_tree_async()
    assert list((scratch.cache_dir / "sdist").iterdir()) == []
    assert not (scratch.cache_dir / "src").exists()


def fake_engine_sources(cache_dir: Path, line_repeats: int = 1) -> Path:
    """A stand-in for the vendored llama.cpp tree, where the engine build looks for it: a
    CMake project that prints a line of `line_repeats` x 15 characters while configuring
    and compiling, records the environment it was given, and builds a `llama-server` and a
    `ggml-rpc-server` (of RPC protocol 9.8.7) in seconds."""
    tree = cache_dir / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "main.c").write_text("int main(void) { return 0; }\n")
    (tree / "ggml" / "include").mkdir(parents=True)
    (tree / "ggml" / "include" / "ggml-rpc.h").write_text(
        "#define RPC_PROTO_MAJOR_VERSION    9\n#define RPC_PROTO_MINOR_VERSION    8\n"
        "#define RPC_PROTO_PATCH_VERSION    7\n")
    (tree / "CMakeLists.txt").write_text(textwrap.dedent("""\
        cmake_minimum_required(VERSION 3.16)
        project(fake_llama C)
        string(REPEAT "configure-says-" @REPEATS@ LONG_CONFIGURE)
        message(STATUS "${LONG_CONFIGURE}")
        execute_process(COMMAND ${CMAKE_COMMAND} -E environment
                        OUTPUT_FILE ${CMAKE_BINARY_DIR}/build-environment.txt)
        set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
        add_executable(llama-server main.c)
        add_executable(ggml-rpc-server main.c)
        string(REPEAT "compiler-says-" @REPEATS@ LONG_COMPILE)
        add_custom_command(TARGET llama-server POST_BUILD
                           COMMAND ${CMAKE_COMMAND} -E echo "${LONG_COMPILE}")
        """).replace("@REPEATS@", str(line_repeats)))
    return tree


async def test_build_output_lines_over_64_kib_are_logged_whole_and_the_build_completes(tmp_path):
    scratch = Engine(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache", patches=())
    fake_engine_sources(scratch.cache_dir, line_repeats=6000)
    events: list[BuildProgress] = []
    built = await scratch.build(progress=events.append, jobs=1)
    assert scratch.installed() and built == scratch.managed_binary()
    log = (scratch.cache_dir / "build" / f"{BuildKey(patches=()).name}.log").read_text()
    assert "configure-says-" * 6000 in log  # 90,000 characters on one line, kept whole
    assert "compiler-says-" * 6000 in log
    assert all(len(e.line) <= 4096 for e in events)  # cut for the window and the terminal
    assert any("configure-says-" in e.line for e in events)


async def test_a_build_installs_llama_server_and_its_rpc_server_together(tmp_path):
    scratch = Engine(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache", patches=())
    fake_engine_sources(scratch.cache_dir)
    built = await scratch.build(jobs=1)
    assert sorted(p.name for p in built.parent.iterdir()) == [
        "engine.json", "ggml-rpc-server", "llama-server"]
    record = json.loads((built.parent / "engine.json").read_text())
    assert record["rpc"] is True and "-DGGML_RPC=ON" in record["cmake_args"]
    assert record["rpc_protocol"] == [9, 8, 7]
    assert protocol_of_engine(built) == RpcProtocol(9, 8, 7)
    assert scratch.rpc_server(backends=["cpu"]) == built.parent / "ggml-rpc-server"


async def test_the_build_tools_are_not_given_the_ports_key_or_hub_tokens(tmp_path, monkeypatch):
    withheld = {"GGUF_STUDIO_API_KEY": "port-key-0123456789abcdef",
                "HF_TOKEN": "hf_secret_token_of_the_user",
                "HUGGING_FACE_HUB_TOKEN": "hf_older_name_of_the_token"}
    for name, value in withheld.items():
        monkeypatch.setenv(name, value)
    scratch = Engine(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache", patches=())
    fake_engine_sources(scratch.cache_dir)
    await scratch.build(jobs=1)
    seen = (scratch.cache_dir / "build" / BuildKey(patches=()).name / "build-environment.txt").read_text()
    assert not any(value in seen for value in withheld.values())
    assert f"PATH={os.environ['PATH']}" in seen  # the rest is the tools' as before
