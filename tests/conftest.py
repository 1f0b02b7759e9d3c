"""Fixtures shared by the whole suite: the real engine and a tiny real model.

`scripts/setup` builds the managed llama-server before the tests run; the tests use that
binary (or GGUF_STUDIO_LLAMA_SERVER) and the vocab-only GGUF files of the same sources.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from backend.engine import Engine  # noqa: E402
from tests.model_factory import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="session")
def llama_server_binary(engine: Engine) -> Path:
    chosen = engine.resolve().chosen
    if chosen is None:
        pytest.fail("no llama-server: run scripts/setup (or `gguf-studio engine build`) first")
    return chosen.path


@pytest.fixture(scope="session")
def source_tree(engine: Engine) -> Path:
    """llama.cpp's sources from the pinned sdist (fetched and unpacked by the engine build)."""
    return engine.source_tree()


@pytest.fixture(scope="session")
def vocab_path(source_tree: Path) -> Path:
    """A vocab-only GGUF (llama SentencePiece, 32k tokens) to give test models a real tokenizer."""
    return source_tree / "models" / "ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, vocab_path: Path) -> Path:
    """A real 17 MB llama GGUF with random weights that llama-server loads in under a second."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf", vocab_path)
