"""Sessions through a real service in front of a real llama-server: agents that resend
their whole conversation each turn have their prefix found again, so each turn after the
first computes about its new tokens only, however many agents share the engine's slots."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.app.service import StudioService
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSettings
from backend.llama.supervisor import PREFIX_CACHE_ARGS, pick_free_port
from tests.backend.admission.test_placement_engines import MODEL, until_engines
from tests.backend.llama.test_remote_engine import _until_healthy, start_llama_server, stop
from tests.backend.service_harness import ServiceFactory

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega").split()
#: Prompt tokens a turn may compute beyond its new ones (a few around the message marks).
SLACK = 8


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(queue_timeout=120)


@contextlib.asynccontextmanager
async def attached_engine(service: StudioService, binary: Path, model: Path, *, parallel: int,
                          ctx: int, extra: tuple[str, ...]) -> AsyncIterator[int]:
    """A llama-server of `parallel` split slots, attached to `service` as an engine
    elsewhere; its port."""
    port = pick_free_port()
    engine = start_llama_server(binary, model, port, parallel=parallel, ctx=ctx, extra=extra)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            await _until_healthy(probe)
        await service.attach_upstream(f"http://127.0.0.1:{port}", kv_layout=KvLayout.SPLIT)
        await until_engines(service, 1)
        yield port
    finally:
        stop(engine)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def turns(client: httpx.AsyncClient, session: str, head: str, count: int,
                rng: random.Random, headers: dict[str, str] | None = None, model: str = MODEL
                ) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """An agent's turns: its whole conversation each time (a shared head, its history,
    a few new words), named by Codex's `session_id` header; each turn's messages and
    answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": head}]
    answers = []
    for turn in range(count):
        messages.append({"role": "user", "content": f"{session} turn {turn}: {words(rng, 60)}"})
        answer = await client.post("/v1/chat/completions",
                                   headers={"session_id": session, **(headers or {})},
                                   json={"model": model, "messages": messages, "max_tokens": 4,
                                         "temperature": 0})
        assert answer.status_code == 200, answer.text
        answers.append((list(messages), answer.json()))
        # The agent's history holds what it kept of the reply (here a fixed line: the
        # tiny model's random tokens would not read back as the same tokens).
        messages.append({"role": "assistant", "content": f"noted {turn}"})
    return answers


async def converse(client: httpx.AsyncClient, session: str, head: str, count: int,
                   rng: random.Random, model: str = MODEL) -> list[tuple[int, int]]:
    """(prompt tokens, computed ones) of each turn's answer, as its `timings` say."""
    return [(answer["timings"]["prompt_n"] + answer["timings"]["cache_n"],
             answer["timings"]["prompt_n"])
            for _messages, answer in await turns(client, session, head, count, rng,
                                                 model=model)]


def recomputed(figures: list[tuple[int, int]]) -> list[int]:
    """Per turn after the first: tokens computed beyond the turn's new ones."""
    return [computed - (prompt - figures[turn - 1][0])
            for turn, (prompt, computed) in enumerate(figures) if turn]


@pytest.mark.parametrize("sessions, slots", [(3, 2), (2, 4)])
async def test_each_turn_computes_about_its_new_tokens_only(
        service: StudioService, llama_server_binary: Path, tiny_model: Path,
        sessions: int, slots: int) -> None:
    async with attached_engine(service, llama_server_binary, tiny_model, parallel=slots,
                               ctx=4096 * slots, extra=PREFIX_CACHE_ARGS):
        rng = random.Random(7)
        head = "You are a coding agent. " + words(rng, 400)  # every agent's fixed head
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                     timeout=120) as client:
            runs = await asyncio.gather(*(
                converse(client, f"agent-{i}", head, 3, random.Random(i))
                for i in range(sessions)))
    extra = [tokens for figures in runs for tokens in recomputed(figures)]
    assert max(extra) <= SLACK, f"turns after the first recomputed {extra} tokens: {runs}"


async def test_an_engine_the_app_starts_keeps_every_agents_prefix_and_says_how(
        service: StudioService, tiny_model: Path) -> None:
    """Four agents on two slots of an engine GGUF Studio started (slots pinned by the
    port, the RAM cache behind every pin): each turn after the first computes its new
    tokens only, and the engine's state says how prefixes are kept, for the Model tab."""
    snapshot = await service.load(LoadSettings(parallel="2", ctx_size=8192).to_spec(str(tiny_model)))
    serving = snapshot.serving
    assert serving is not None and serving.pin_any_slot
    assert serving.prefix_note and "RAM prompt cache" in serving.prefix_note
    rng = random.Random(3)
    head = "You are a coding agent. " + words(rng, 400)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120) as client:
        runs = await asyncio.gather(*(
            converse(client, f"agent-{i}", head, 3, random.Random(i), model="tiny")
            for i in range(4)))
    extra = [tokens for figures in runs for tokens in recomputed(figures)]
    assert max(extra) <= SLACK, f"turns after the first recomputed {extra} tokens: {runs}"


async def test_two_keys_sessions_of_the_same_names_keep_their_own_caches_and_hear_of_none(
        service: StudioService, llama_server_binary: Path, tiny_model: Path) -> None:
    """Two keys, each with agents of the same session names and the same head, at once on
    two slots: every answer is the one the engine gives that prompt computed afresh
    (no other conversation's cache in it), neither key is told what the cache held, and
    the port keeps each key's sessions apart."""
    async with attached_engine(service, llama_server_binary, tiny_model, parallel=2, ctx=8192,
                               extra=PREFIX_CACHE_ARGS) as port:
        keys = [service.add_key(name)[1] for name in ("alice", "bob")]
        head = "You are a coding agent. " + words(random.Random(5), 300)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                     timeout=120) as client:
            runs = await asyncio.gather(*(
                turns(client, f"agent-{i}", head, 2, random.Random(10 * k + i),
                      {"Authorization": f"Bearer {key}"})
                for k, key in enumerate(keys) for i in range(4)))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as direct:
            for messages, answer in (turn for run in runs for turn in run):
                fresh = await direct.post("/v1/chat/completions", json={
                    "messages": messages, "max_tokens": 4, "temperature": 0,
                    "cache_prompt": False})
                assert (answer["choices"][0]["message"]["content"]
                        == fresh.json()["choices"][0]["message"]["content"])
                assert "timings" not in answer
                assert not (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    sessions = service.registry.sessions.snapshot()
    assert len(sessions) == 8 and len({s.flow for s in sessions}) == 2
    assert all(s.key.startswith(s.flow + "\n") and s.turns == 2 for s in sessions)


async def test_an_agents_turn_after_its_title_request_finds_its_prefix_in_its_slot(
        service: StudioService, llama_server_binary: Path, tiny_model: Path) -> None:
    """OpenCode sends its title request with its agent's session headers: the agent's next
    turn still goes to the slot holding the agent's conversation and computes only its new
    tokens (no RAM prompt cache here to hide a pin to the title's slot)."""
    async with attached_engine(service, llama_server_binary, tiny_model, parallel=4,
                               ctx=4096 * 4, extra=(*PREFIX_CACHE_ARGS, "--cache-ram", "0")):
        rng = random.Random(11)
        session = {"x-session-affinity": "ses_title"}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. " + words(rng, 400)},
            {"role": "user", "content": words(rng, 40)}]
        title = [{"role": "system", "content": "You are a title generator. Output a title."},
                 {"role": "user", "content": messages[1]["content"]}]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                     timeout=120) as client:
            async def ask(messages: list[dict[str, Any]]) -> dict[str, Any]:
                answer = await client.post("/v1/chat/completions", headers=session, json={
                    "model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0})
                assert answer.status_code == 200, answer.text
                timings: dict[str, Any] = answer.json()["timings"]
                return timings

            first = await ask(messages)
            await ask(title)
            messages += [{"role": "assistant", "content": "noted"},
                         {"role": "user", "content": words(rng, 40)}]
            second = await ask(messages)
    new_tokens = second["prompt_n"] + second["cache_n"] - first["prompt_n"] - first["cache_n"]
    assert second["cache_n"] >= first["prompt_n"] + first["cache_n"] - SLACK, (first, second)
    assert second["prompt_n"] <= new_tokens + SLACK, (first, second)
