"""A model without a chat template, through the port with the real engine and the real
Gemma 3 270M (which has none): its chat routes answer a clear 400 instead of the junk the
engine's fallback template makes, plain completion works, a template the owner picks (a
llama.cpp built-in, or a Jinja file) makes the chat routes work, and /health says which,
also in front of another GGUF Studio port serving it."""

from __future__ import annotations

import httpx
import pytest

from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.pool.pool_status import Residency
from backend.app.service import StudioService
from backend.llama.api import engine_headers
from backend.llama.chat_template import TemplateSource
from backend.llama.load import LoadSettings
from backend.llama.supervisor import pick_free_port
from tests.backend.app.pool.test_pool import STUDIO_KEY, until
from tests.backend.llama.test_remote_engine import _until_healthy, end_studio, start_studio
from tests.backend.service_harness import ServiceFactory

SMALL = LoadSettings(parallel="1", ctx_size=2048, threads=1)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
#: Each chat route's smallest request.
CHATS = {
    "/v1/chat/completions": {"messages": QUESTION, "max_tokens": 8},
    "/v1/responses": {"input": "What is the capital of France?", "max_output_tokens": 8},
    "/v1/messages": {"messages": QUESTION, "max_tokens": 8},
}
#: Gemma's turns, as a Jinja file an owner might write.
GEMMA_JINJA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
               "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}"
               "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
               "{% endif %}")


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(queue_timeout=120)


@pytest.fixture
def client(port_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return port_client


async def test_a_model_without_a_chat_template_refuses_chats_with_a_clear_400_and_takes_prompts(
        service, client, gemma3_model):
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(gemma3_model, name="gemma", settings=SMALL, preload=False),)))

    for path, body in CHATS.items():
        answer = await client.post(path, json={"model": "gemma", **body})
        assert answer.status_code == 400, (path, answer.text)
        error = answer.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "model_has_no_chat_template", "model"), path
        assert "gemma has no chat template" in error["message"]
        assert "/v1/completions" in error["message"]
    # Refused before anything was loaded for it.
    assert service.pool.status("gemma").residency is Residency.UNLOADED

    completion = await client.post("/v1/completions", json={
        "model": "gemma", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"].strip()

    health = (await client.get("/health")).json()
    template = health["models"][0]["chat_template"]
    assert {k: template[k] for k in ("source", "name", "model_has_one", "takes_chats")} == {
        "source": "none", "name": None, "model_has_one": False, "takes_chats": False}
    assert "400 model_has_no_chat_template" in template["note"]


async def test_a_built_in_template_the_owner_picks_makes_the_chat_routes_work(
        service, client, gemma3_model):
    await service.start_pool(PoolConfig(models=(ModelEntry.for_file(
        gemma3_model, name="gemma", settings=LoadSettings(
            parallel="1", ctx_size=2048, threads=1, chat_template="gemma")),)))

    for path, body in CHATS.items():
        answer = await client.post(path, json={"model": "gemma", "temperature": 0, **body})
        assert answer.status_code == 200, (path, answer.text)
    reply = (await client.post("/v1/chat/completions", json={
        "model": "gemma", "messages": QUESTION, "max_tokens": 8, "temperature": 0})).json()
    assert reply["choices"][0]["message"]["content"].strip()
    # The engine renders chats with Gemma's turns, not its ChatML fallback.
    assert await rendered(service, "gemma") == (
        "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n")

    template = (await client.get("/health")).json()["models"][0]["chat_template"]
    assert (template["source"], template["name"], template["takes_chats"], template["note"]) == (
        "built-in", "gemma", True, None)


async def test_a_template_file_the_owner_picks_renders_chats_and_takes_tools(
        service, client, gemma3_model, tmp_path):
    jinja = tmp_path / "private" / "gemma-turns.jinja"
    jinja.parent.mkdir()
    jinja.write_text(GEMMA_JINJA)
    await service.start_pool(PoolConfig(models=(ModelEntry.for_file(
        gemma3_model, name="gemma", settings=LoadSettings(
            parallel="1", ctx_size=2048, threads=1, chat_template=str(jinja))),)))

    tool = {"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string"}}}}}
    answer = await client.post("/v1/chat/completions", json={
        "model": "gemma", "messages": QUESTION, "max_tokens": 8, "temperature": 0,
        "tools": [tool]})
    assert answer.status_code == 200, answer.text  # a Jinja template takes tools
    assert (await rendered(service, "gemma")).endswith(
        "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n")

    template = (await client.get("/health")).json()["models"][0]["chat_template"]
    assert (template["source"], template["name"]) == ("file", "gemma-turns.jinja")
    assert str(jinja.parent) not in str(template)  # no paths in /health


async def rendered(service: StudioService, model: str) -> str:
    """The prompt the model's engine makes of QUESTION (llama-server's /apply-template)."""
    serving = service.pool.snapshot(model).serving
    assert serving is not None
    async with httpx.AsyncClient(headers=engine_headers(serving.api_key), timeout=60) as engine:
        answer = await engine.post(f"{serving.base_url}/apply-template", json={"messages": QUESTION})
    assert answer.status_code == 200, answer.text
    prompt: str = answer.json()["prompt"]
    return prompt



async def test_a_gguf_studio_port_behind_says_its_model_has_none_and_its_400_reaches_the_client(
        service, client, tmp_path, llama_server_binary, gemma3_model):
    """Another GGUF Studio port (a real `serve` process) serves Gemma 3 270M: the port in
    front says what that port says of its template, and relays its 400 as it is."""
    port = pick_free_port()
    home = tmp_path / "inner"
    home.mkdir()
    inner = start_studio(home, llama_server_binary, gemma3_model, port, parallel=1,
                         extra=("--threads", "1"))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            await _until_healthy(probe, timeout=120)
        await service.attach_upstream(f"http://127.0.0.1:{port}", api_key=STUDIO_KEY)
        name = gemma3_model.name.removesuffix(".gguf")
        await until(lambda: service.pool.names() == [name])
        template = service.pool.status(name).chat_template
        assert template is not None and (template.source, template.takes_chats) == (
            TemplateSource.NONE, False)
        said = (await client.get("/health")).json()["models"][0]["chat_template"]
        assert (said["source"], said["takes_chats"]) == ("none", False)

        answer = await client.post("/v1/chat/completions", json={"model": name, **CHATS[
            "/v1/chat/completions"]})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "model_has_no_chat_template"
        completion = await client.post("/v1/completions", json={
            "model": name, "prompt": "The capital of France is", "max_tokens": 4})
        assert completion.status_code == 200, completion.text
    finally:
        end_studio(inner)
