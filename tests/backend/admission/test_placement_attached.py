"""Sessions on plain llama-servers attached at their defaults keep their prefixes.

Real engines: two llama-servers started by hand as a user would (the managed binary,
SmolLM2, `-np 2`, llama.cpp's default slot similarity and RAM prompt cache), attached
with `--upstream ... --upstream-kv split` (`attach_upstream`), sessions through the
port.  At llama.cpp's default similarity a turn sent to a slot that holds another
session's prompt reuses that prompt in place from the shared head on, and the returning
session's own prefix, in the engine's RAM prompt cache, is not looked at: every turn
after the first slot change computed its whole conversation past the head.  A Claude
Code turn (`/v1/messages`, which llama-server cannot be told a slot for) took the idle
slot most like its prompt, any sharing the head, the same way.  What a user
notices is each turn's prompt figures in its answer's `timings`: a turn that continues
its conversation computes its new tokens, not the conversation again.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from collections.abc import Callable
from typing import Any

import httpx

from backend.app.service import StudioService
from backend.llama.accelerators import cpu_claims_amx
from backend.llama.kv_capacity import KvLayout
from backend.llama.supervisor import pick_free_port
from tests.backend.llama.test_remote_engine import _until_healthy, start_llama_server, stop
from tests.backend.service_harness import ServiceFactory

MODEL = "elsewhere"  # the alias `start_llama_server` gives
WORDS = ("function return value error import class module test file path string list index "
         "buffer stream token parse build change commit branch merge request async await "
         "result option config server client socket thread queue lock event handler").split()


def engine_flags(*extra: str) -> tuple[str, ...]:
    """As a user starts it on this machine: one thread (the machine is shared) and, where
    the CPU claims AMX, without the repacked layouts SmolLM2 dies in."""
    return ("--threads", "1", *(("--no-repack",) if cpu_claims_amx() else ()), *extra)


async def attach(service: StudioService, binary: Path, model: Path, *extra: str) -> Any:
    port = pick_free_port()
    process = start_llama_server(binary, model, port, parallel=2, ctx=4096,
                                 extra=engine_flags(*extra))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        await _until_healthy(client)
    line = service.registry.line(MODEL)
    engines = len(line.engines)
    await service.attach_upstream(f"http://127.0.0.1:{port}", kv_layout=KvLayout.SPLIT)
    async with asyncio.timeout(90):  # the port asks the engine what it keeps first
        while len(line.engines) <= engines:
            await asyncio.sleep(0.05)
    return process


class Agent:
    """One coding agent's conversation: the head every agent shares, then its turns."""

    def __init__(self, name: str, head: str, seed: int, *, anthropic: bool = False) -> None:
        self.name = name
        #: Speaks Anthropic's Messages API, as Claude Code does: llama-server drops the
        #: `id_slot` of such a request, so the port cannot pin it.
        self.anthropic = anthropic
        self.rng = random.Random(seed)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": head}]
        self.prompts: list[int] = []  # each turn's prompt tokens (computed + cached)
        self.computed: list[int] = []

    async def turn(self, client: httpx.AsyncClient, *, reply_tokens: int = 4) -> None:
        """One turn; `reply_tokens` more than 4: that many exactly (a long-running turn)."""
        self.messages.append({"role": "user", "content": " ".join(
            self.rng.choice(WORDS) for _ in range(60))})
        if self.anthropic:
            answer = await client.post(
                "/v1/messages", headers={"X-Claude-Code-Session-Id": self.name},
                json={"model": MODEL, "system": self.messages[0]["content"],
                      "messages": self.messages[1:], "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200, answer.text
            body = answer.json()
            computed, cached = body["usage"]["input_tokens"], body["usage"]["cache_read_input_tokens"]
            reply = "".join(part["text"] for part in body["content"] if part["type"] == "text")
        else:
            answer = await client.post(
                "/v1/chat/completions", headers={"x-session-affinity": self.name},
                json={"model": MODEL, "messages": self.messages, "max_tokens": reply_tokens,
                      "temperature": 0, **({"ignore_eos": True} if reply_tokens > 4 else {})})
            assert answer.status_code == 200, answer.text
            body = answer.json()
            computed, cached = body["timings"]["prompt_n"], body["timings"]["cache_n"]
            reply = body["choices"][0]["message"]["content"]
        self.prompts.append(computed + cached)
        self.computed.append(computed)
        self.messages.append({"role": "assistant", "content": reply})

    def new_tokens(self, turn: int) -> int:
        """What turn `turn` (>= 1) added to the conversation: no cache can hold it."""
        return self.prompts[turn] - self.prompts[turn - 1]


async def test_three_sessions_an_engine_of_two_slots_compute_only_their_new_tokens(
        running_service: ServiceFactory, llama_server_binary: Path, smollm2_model: Path) -> None:
    # The pool, smaller: 2 plain llama-servers of 2 slots, 6 agents sharing a
    # ~500-token head, 3 turns each, every agent's turn in every round: 3 agents live on
    # each engine, so every round each engine's slots change hands.
    service = await running_service(queue_timeout=120)
    processes = []
    try:
        for _ in range(2):
            processes.append(await attach(service, llama_server_binary, smollm2_model))
        head_rng = random.Random(7)
        head = "You are a coding agent. Follow the rules.\n" + " ".join(
            head_rng.choice(WORDS) for _ in range(400))
        # A third speak as Claude Code does: turns the port cannot pin.
        agents = [Agent(f"agent-{n}", head, n, anthropic=n % 3 == 2) for n in range(6)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                     timeout=120) as client:
            for _ in range(3):
                for agent in agents:
                    await agent.turn(client)
            health = (await client.get("/health")).json()
        # Each later turn computed no more than what it added (before: the conversation
        # past the head, once its slot had held another agent's turn).
        for agent in agents:
            for turn in (1, 2):
                assert agent.computed[turn] <= agent.new_tokens(turn) + 2, \
                    (agent.name, turn, agent.computed, agent.prompts, service.parking.counts)
        # Engines at their defaults keep prefixes: nothing to warn about.
        assert [upstream["note"] for upstream in health["upstreams"]] == [None, None]
    finally:
        for process in processes:
            stop(process)


async def test_an_attached_engine_without_a_ram_prompt_cache_is_named_in_health_with_the_fix(
        running_service: ServiceFactory, llama_server_binary: Path, tiny_model: Path) -> None:
    service = await running_service(queue_timeout=60)
    processes = []
    try:
        processes.append(await attach(service, llama_server_binary, tiny_model))
        processes.append(await attach(service, llama_server_binary, tiny_model,
                                      "--cache-ram", "0"))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}") as client:
            health = (await client.get("/health")).json()
        first, second = health["upstreams"]
        assert first["note"] is None
        assert second["note"] == (
            "This engine does not bring a prompt back from its RAM prompt cache (--cache-ram 0, "
            "or --slot-prompt-similarity 0): a session whose slot another took computes its "
            "whole prompt again. Start it with --slot-prompt-similarity 1 and without "
            "--cache-ram 0.")
        # The window's Pool tab reads the same words from the pool's status.
        rows = {status.engine.where: status.engine.note
                for status in service.pool.upstream_statuses()}
        assert rows == {first["engine"]: None, second["engine"]: second["note"]}
    finally:
        for process in processes:
            stop(process)


async def test_a_turn_the_engine_cannot_pin_never_takes_the_slot_a_pinned_turn_is_headed_for(
        running_service: ServiceFactory, llama_server_binary: Path, smollm2_model: Path) -> None:
    # Three agents on one engine of 2 slots: each round one chat agent's turn alone, then
    # another chat agent's and a Claude Code agent's turns sent together.  The engine
    # seats the unpinned one on the idle slot with the oldest stamp *there*; a pinned
    # turn admitted beside it is idle there until its request arrives.  Before the port
    # held the unpinned turn until the pinned one's slot took it, the unpinned one could
    # land there first (measured on the pool: 1.48x and 1.64x the floor), and the pinned
    # session's next turn found another's prompt and computed its conversation past the
    # head again.  Which request reaches the engine first is the engine's and the
    # sockets' race: the order is forced in test_line_sessions, this checks the outcome.
    service = await running_service(queue_timeout=120)
    process = await attach(service, llama_server_binary, smollm2_model)
    try:
        head_rng = random.Random(11)
        head = "You are a coding agent. Follow the rules.\n" + " ".join(
            head_rng.choice(WORDS) for _ in range(400))
        alone, pinned, claude = (Agent("alone", head, 1), Agent("pinned", head, 2),
                                 Agent("claude", head, 3, anthropic=True))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                     timeout=120) as client:
            for _ in range(4):
                await alone.turn(client)
                await asyncio.gather(pinned.turn(client), claude.turn(client))
        for agent in (pinned, claude, alone):
            for turn in range(1, 4):
                assert agent.computed[turn] <= agent.new_tokens(turn) + 2, \
                    (agent.name, turn, agent.computed, agent.prompts, service.parking.counts)
    finally:
        stop(process)


async def test_a_turn_admitted_as_another_ends_on_its_slot_finds_its_own_prefix(
        running_service: ServiceFactory, llama_server_binary: Path, smollm2_model: Path) -> None:
    # One engine of 2 slots.  `early` holds slot A; `other`, coming back, is seated on A
    # (A's prompt to the RAM cache first) while `long` runs on the other slot; `early`'s
    # next turn arrives then and waits for a slot, and goes in the moment `other` ends.
    # The port's book learnt that A no longer holds `early` only once `other`'s answer
    # was recorded, after that moment: `early` was sent to A as if its prefix were there,
    # and llama-server reused `other`'s prompt in place from the shared head on.
    service = await running_service(queue_timeout=180)
    process = await attach(service, llama_server_binary, smollm2_model)
    try:
        head_rng = random.Random(5)
        head = "You are a coding agent. Follow the rules.\n" + " ".join(
            head_rng.choice(WORDS) for _ in range(300))
        early, other = Agent("early", head, 1), Agent("other", head, 2)
        # Another conversation, sharing nothing: its first turn moves what its slot held
        # to the RAM cache instead of reusing it in place.
        long = Agent("long", "Translate the words you are given into French.", 3)
        line = service.registry.line(MODEL)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                     timeout=180) as client:
            await early.turn(client)   # slot 1 (never used ones first, the highest id)
            await other.turn(client)   # slot 0
            await long.turn(client)    # the least recently used slot: early's, to RAM
            await early.turn(client)   # back: the least recently used slot, other's
            running = asyncio.create_task(long.turn(client, reply_tokens=48))
            await _until(lambda: line.engines[0].free_slots == 1)
            returning = asyncio.create_task(other.turn(client))  # seated on early's slot
            await _until(lambda: line.engines[0].free_slots == 0)
            waiting = asyncio.create_task(early.turn(client))
            await _until(lambda: line.waiting == 1)
            await asyncio.gather(running, returning, waiting)
        for agent in (early, other):
            for turn in range(1, len(agent.prompts)):
                assert agent.computed[turn] <= agent.new_tokens(turn) + 2, \
                    (agent.name, turn, agent.computed, agent.prompts)
    finally:
        stop(process)


async def _until(condition: Callable[[], bool], seconds: float = 60) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.01)
