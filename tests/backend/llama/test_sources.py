"""The engine's sources come from a package index that may be hostile: nothing it serves
runs, and only the pinned file is kept.  A local PEP 503 index stands in for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import backend.llama.engine as engine_module
from backend.llama.engine import LLAMA_CPP_PYTHON_VERSION, Engine
from backend.errors import EngineBuildFailed
from tests.package_index import PackageIndex, hostile_sdist, sha256

SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"


def only_this_index(index: PackageIndex) -> dict[str, str]:
    """The environment of a user whose pip is configured with `index` alone."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return environ | {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index.url}


def use_only(index: PackageIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index.url)


def test_a_tampered_sdist_is_refused_by_engine_build_before_any_of_its_code_runs(tmp_path: Path):
    marker = tmp_path / "index-code-ran"
    data_dir = tmp_path / "data"
    with PackageIndex() as index:
        index.add("llama-cpp-python", SDIST,
                  hostile_sdist("llama_cpp_python", LLAMA_CPP_PYTHON_VERSION, marker))
        done = subprocess.run(
            [sys.executable, "-m", "backend.app.cli", "engine", "build", "--backend", "cpu"],
            env=only_this_index(index) | {"GGUF_STUDIO_DATA_DIR": str(data_dir)},
            capture_output=True, text=True, timeout=120)
        asked = list(index.requests)
    assert done.returncode == 1
    assert "gguf-studio: The llama.cpp sources failed their hash check" in done.stderr
    assert "refusing to build them" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()
    assert f"/files/{SDIST}" in asked  # it was offered, fetched, and refused
    assert list((data_dir / "cache" / "sdist").iterdir()) == []
    assert not (data_dir / "cache" / "src").exists()
    assert not (data_dir / "engines").exists()


async def test_sources_matching_the_pin_are_unpacked_without_running_anything_from_the_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """pip would, once the hash matched, fetch the sdist's build backend from the index
    (without any hash) and run it to read the sdist's metadata; the build needs only the
    files."""
    marker = tmp_path / "index-code-ran"
    sdist = hostile_sdist("llama_cpp_python", LLAMA_CPP_PYTHON_VERSION, marker,
                          build_requires="build-helper")
    with PackageIndex() as index:
        index.add("llama-cpp-python", SDIST, sdist)
        index.add("build-helper", "build_helper-1.0.tar.gz",
                  hostile_sdist("build_helper", "1.0", marker))
        use_only(index, monkeypatch)
        monkeypatch.setattr(engine_module, "LLAMA_CPP_PYTHON_SDIST_SHA256", sha256(sdist))
        monkeypatch.setattr(engine_module, "LLAMA_CPP_PYTHON_SDIST_SIZE", len(sdist))
        scratch = Engine(data_dir=tmp_path / "data")
        tree = await scratch.source_tree_async()
        asked = list(index.requests)
    assert (tree / "CMakeLists.txt").is_file()
    assert not marker.exists()
    assert not any("build-helper" in path for path in asked)
    assert (scratch.cache_dir / "sdist" / SDIST).read_bytes() == sdist


async def test_an_index_that_sends_more_than_the_pinned_size_is_cut_off_and_nothing_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    marker = tmp_path / "index-code-ran"
    sdist = hostile_sdist("llama_cpp_python", LLAMA_CPP_PYTHON_VERSION, marker)
    with PackageIndex() as index:
        index.add("llama-cpp-python", SDIST, sdist + b"\0" * (1 << 20))
        use_only(index, monkeypatch)
        monkeypatch.setattr(engine_module, "LLAMA_CPP_PYTHON_SDIST_SHA256", sha256(sdist))
        monkeypatch.setattr(engine_module, "LLAMA_CPP_PYTHON_SDIST_SIZE", len(sdist))
        scratch = Engine(data_dir=tmp_path / "data")
        with pytest.raises(EngineBuildFailed, match="longer than the pinned"):
            await scratch.source_tree_async()
    assert list((scratch.cache_dir / "sdist").iterdir()) == []
    assert not (scratch.cache_dir / "src").exists()


async def test_an_index_without_the_sources_is_named_in_the_refusal_without_its_credentials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with PackageIndex() as index:
        use_only(index, monkeypatch)
        origin = index.url.removesuffix("/simple")
        monkeypatch.setenv("PIP_INDEX_URL", index.url.replace("://", "://someone:s3cret@"))
        scratch = Engine(data_dir=tmp_path / "data")
        with pytest.raises(EngineBuildFailed) as refused:
            await scratch.source_tree_async()
    assert f"No package index offers {SDIST} (asked {origin}," in str(refused.value)
    assert "s3cret" not in str(refused.value)
    assert list((scratch.cache_dir / "sdist").iterdir()) == []
