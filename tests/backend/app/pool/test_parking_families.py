"""Parked prefixes of the families that are not dense, through the port, on the real
engine: Gemma 3 (most layers keep a sliding window), a `qwen35` hybrid (recurrent layers)
and a sliding-window `gpt-oss` mixture of experts.  Their memory cannot be rolled back,
so a parked prefix serves the next turn only with the slot's context checkpoints, which
GGUF Studio's engine keeps in the file (backend/data/llama-cpp-patches): these tests need
that engine (`gguf-studio engine build`).  Each turn's assistant message is the client's
own text, not the model's reply, so every turn parts from the cached one where the last
reply began, as a client that rewrites its answers does."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.pool.pool_status import Residency
from backend.app.service import StudioService
from backend.llama.engine import Engine
from backend.llama.load import LoadSettings, Serving
from backend.llama.slot_parking import INDEX_NAME, ParkKey
from backend.settings import Settings
from tests.backend.app.pool.test_parking_steward import (  # noqa: F401
    Figures, parked_files, port, studio, until)
from tests.backend.service_harness import ServiceFactory
from tests.not_none import not_none

SETTINGS = LoadSettings(parallel="2", ctx_size=8192)
#: An agent's fixed head: about 700 tokens of instructions.
HEAD = " ".join(f"Rule {n}: read the file before editing it, and keep edit {n} small."
                for n in range(40))
STEP = " ".join(f"test_{n} passed in 0.{n} seconds." for n in range(8))
#: Each family's fixture, and whether its chats are rendered by its own template (Gemma
#: 3 270M has none: its turns are plain completions of a prompt the client renders).
FAMILIES = {"gemma3": ("gemma3_model", False), "hybrid": ("hybrid_model", True),
            "moe": ("swa_moe_model", True)}


@pytest.fixture
def family_model(request: pytest.FixtureRequest) -> Path:
    """The model fixture the test's family names (set up before the test's loop)."""
    model: Path = request.getfixturevalue(FAMILIES[request.param][0])
    return model


@pytest.mark.parametrize("family_model, family", [(f, f) for f in FAMILIES],
                         indirect=["family_model"])
async def test_the_first_turn_after_an_idle_unload_computes_little_of_its_prompt(
        studio: ServiceFactory, family_model: Path, family: str):
    chat = FAMILIES[family][1]
    service = await serving(studio, family_model, idle_ttl=1.0)
    async with port(service) as client:
        first = await turn(client, chat, "idle-1", 1)
        second = await turn(client, chat, "idle-1", 2)
        parks(service)
        await unloaded_for_idleness(service)
        checkpoints = parked_checkpoints(service)
        third = await turn(client, chat, "idle-1", 3)
        fourth = await turn(client, chat, "idle-1", 4)
    print(f"{family}: live turn 2 computed {second}, after the unload turn 3 {third}, "
          f"then {fourth}; {checkpoints} checkpoints parked")
    assert first.computed == first.prompt
    assert second.computed <= 0.15 * second.prompt  # live: the checkpoints at work
    # Parked with its context checkpoints, restored with them, and taken up.
    assert checkpoints and min(checkpoints) >= 1
    assert service.parking.counts["restored"] == 1
    assert third.computed <= 0.15 * third.prompt
    assert fourth.computed <= 0.15 * fourth.prompt


async def test_a_hybrid_sessions_first_turn_after_a_restart_computes_little_of_its_prompt(
        tmp_path: Path, llama_server_binary: Path, hybrid_model: Path):
    config = PoolConfig(models=(ModelEntry.for_file(str(hybrid_model), name="m",
                                                    settings=SETTINGS),))
    settings = Settings(port=0, llama_server=str(llama_server_binary), load_timeout=60)
    engine = Engine(data_dir=tmp_path / "data")
    figures: list[Figures] = []
    for _ in range(2):  # `serve` stopping parks its sessions; the next one restores them
        service = StudioService(settings, engine=engine, log_dir=tmp_path / "logs")
        try:
            await service.start_gateway()
            await service.start_pool(config)
            async with port(service) as client:
                figures.append(await turn(client, True, "restart-1", len(figures) + 1))
        finally:
            await service.close()
    first, second = figures
    print(f"hybrid: after a restart turn 2 computed {second}")
    assert first.computed == first.prompt
    assert second.computed <= 0.15 * second.prompt


async def test_a_new_conversation_under_a_parked_sessions_name_gets_none_of_its_prefix(
        studio: ServiceFactory, hybrid_model: Path):
    """An agent run again under the same session ids: its first turns are the start of
    the parked conversation.  The parked prefix is not restored into them (a recurrent
    state cannot be cut back to them, and llama-server would keep it in its RAM cache,
    where the session's next turns found it instead of their own): the rerun's turns
    compute what they would have without a parked file."""
    service = await serving(studio, hybrid_model, idle_ttl=1.0)
    async with port(service) as client:
        for n in (1, 2, 3):
            await turn(client, True, "rerun-1", n)
        parks(service)
        await unloaded_for_idleness(service)
        again = [await turn(client, True, "rerun-1", n) for n in (1, 2, 3)]
    print(f"hybrid, the conversation again under its parked name: {again}")
    assert service.parking.counts["not_continued"] == 1
    assert service.parking.counts["restored"] == service.parking.counts["not_taken"] == 0
    assert again[0].computed == again[0].prompt  # a first turn: nothing to reuse
    assert all(f.computed <= 0.15 * f.prompt for f in again[1:])


async def test_a_restore_that_does_not_take_is_dropped_and_leaves_its_session_warm(
        studio: ServiceFactory, hybrid_model: Path):
    """A parked file that claims to continue the turn but holds another conversation (an
    injected fault: the index says one session's prompt, the file is the other's) is
    restored, does not take, and is dropped; the turn computes its prompt, and the turns
    after it, of both sessions, compute only what is new."""
    service = await serving(studio, hybrid_model, idle_ttl=1.0)
    heads = {name: f"You work for {name}. " + HEAD for name in ("mixed-a", "mixed-b")}
    async with port(service) as client:
        for name, head in heads.items():
            for n in (1, 2):
                await turn(client, True, name, n, head=head)
        parks(service)
        await unloaded_for_idleness(service)
        swap_parked_file(service, "mixed-a", "mixed-b")
        a3 = await turn(client, True, "mixed-a", 3, head=heads["mixed-a"])
        a4 = await turn(client, True, "mixed-a", 4, head=heads["mixed-a"])
        b3 = await turn(client, True, "mixed-b", 3, head=heads["mixed-b"])
        b4 = await turn(client, True, "mixed-b", 4, head=heads["mixed-b"])
    print(f"hybrid, a restore that did not take: a {a3} then {a4}; b {b3} then {b4}")
    assert service.parking.counts["not_taken"] == 1
    assert service.parking.counts["restored"] == 1  # b's own, which took
    assert a3.computed >= 0.9 * a3.prompt
    assert all(f.computed <= 0.15 * f.prompt for f in (a4, b3, b4))
    assert len(parked_files(service.parking)) == 1  # a's is gone, b's stays


# Not the hybrid: its random replies do not read back as the tokens it wrote (the phi-3
# vocabulary splits their text otherwise), so its next turn parts from the cached one
# inside the reply, as a rewriting client's does (the same with and without patch 0004).
@pytest.mark.parametrize("family_model, family", [("gemma3", "gemma3"), ("moe", "moe")],
                         indirect=["family_model"])
async def test_the_next_turn_does_not_compute_the_last_reply_again(
        studio: ServiceFactory, family_model: Path, family: str):
    """A client that sends each reply back as the model wrote it (plain completions): the
    slot checkpointed where its reply ended (our engine patch 0004), so the next turn
    computes only what it adds, also when its prompt came back from llama-server's RAM
    cache (two other sessions took the 2 slots) and from its parked file (an idle
    unload).  Without that checkpoint such a turn on a sliding-window model rolled back
    to before the reply and computed it again."""
    service = await serving(studio, family_model, idle_ttl=1.0)
    async with port(service) as client:
        a = Conversation("own-reply-a")
        await a.turn(client)
        live = await a.turn(client)
        for other in ("own-reply-b", "own-reply-c"):  # A's prompt goes to the RAM cache
            await Conversation(other, head=f"You work for {other}. {HEAD}").turn(client)
        from_ram_cache = await a.turn(client)
        parks(service)
        await unloaded_for_idleness(service)
        after_unload = await a.turn(client)
    print(f"{family}, replies sent back as written: live {live}, from the RAM cache "
          f"{from_ram_cache}, after the unload {after_unload}")
    assert service.parking.counts["restored"] == 1
    for turn_figures in (live, from_ram_cache, after_unload):
        turn_figures.computed_only_what_it_added()


async def test_what_parking_does_is_said_per_model_and_engine(studio: ServiceFactory,
                                                             hybrid_model: Path,
                                                             gemma3_model: Path,
                                                             tiny_model: Path):
    service = await studio()
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(hybrid_model), name="hybrid", settings=SETTINGS),
        ModelEntry.for_file(str(gemma3_model), name="gemma3", settings=SETTINGS),
        ModelEntry.for_file(str(tiny_model), name="tiny", settings=SETTINGS))))
    async with port(service) as client:
        health = (await client.get("/health")).json()
    said = {m["id"]: m["parking"] for m in health["models"]}
    assert said["tiny"]["parks"] and said["tiny"]["rollback"] == ""
    hybrid = said["hybrid"]
    assert hybrid["rollback"] == "a recurrent state" and hybrid["checkpoints"] >= 1
    assert hybrid["parks"], hybrid["says"]  # GGUF Studio's engine keeps the checkpoints
    # A checkpoint of Gemma 3 270M is its 512-token window in its 15 sliding layers: 7.5
    # MiB (said rounded), as the engine logs it when it makes one; not the 15 MiB of a
    # slot's padded window.
    loaded = Serving("http://127.0.0.1:9", 2, parks_checkpoints=True)
    gemma3 = service.parking.ability("gemma3", loaded)
    assert gemma3.parks and gemma3.rollback == "a sliding window"
    assert "up to 4 a slot, about 8 MiB each" in gemma3.says
    # An engine that does not keep them (a llama-server built elsewhere): nothing parked,
    # and the reason says what would.
    plain = Serving("http://127.0.0.1:9", 2, parks_checkpoints=False)
    ability = service.parking.ability("hybrid", plain)
    assert not ability.parks and "gguf-studio engine build" in ability.says
    assert service.parking.ability("tiny", plain).parks  # a dense model needs none


# --- helpers -----------------------------------------------------------------------------


async def serving(studio: ServiceFactory, model: Path, *, idle_ttl: float = 0.0
                  ) -> StudioService:
    """A service whose pool serves `model` as "m" on 2 slots (`SETTINGS`)."""
    service = await studio()
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(model), name="m", settings=SETTINGS, idle_ttl=idle_ttl),)))
    return service


async def unloaded_for_idleness(service: StudioService) -> None:
    await until(lambda: service.pool.status("m").residency is Residency.EVICTED)


def parks(service: StudioService) -> None:
    """The model parks on this engine (else these tests measure nothing of it)."""
    ability = service.parking.ability("m", service.pool.snapshot("m").serving)
    assert ability.parks, ability.says


def parked_checkpoints(service: StudioService) -> list[int]:
    """The context checkpoints the engine said it kept in each parked file."""
    index = json.loads((service.parking.lot.directory / INDEX_NAME).read_text())
    return [entry["checkpoints"] for entry in index["parked"]]


class Conversation:
    """An agent's session in plain completions that sends each reply back as the model
    wrote it."""

    def __init__(self, session: str, head: str = HEAD) -> None:
        self.session = session
        self.prompt = f"system: {head}\n"
        self.steps = 0
        self.last: tuple[int, int] | None = None  # (prompt, reply) tokens of the last turn

    async def turn(self, client: httpx.AsyncClient) -> OwnReplyFigures:
        self.steps += 1
        self.prompt += f"user: Step {self.steps}: {STEP}\nassistant:"
        answer = await client.post("/v1/completions", json={
            "model": "m", "prompt": self.prompt, "max_tokens": 16, "temperature": 0,
            "prompt_cache_key": self.session})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        figures = OwnReplyFigures(body["timings"], self.last)
        self.last = (figures.prompt, body["usage"]["completion_tokens"])
        self.prompt += body["choices"][0]["text"] + "\n"
        return figures


class OwnReplyFigures(Figures):
    """A turn's figures, and what it added to the last turn's prompt and reply."""

    def __init__(self, timings: dict[str, int], last: tuple[int, int] | None) -> None:
        super().__init__(timings)
        self.reply = last[1] if last else 0
        self.added = self.prompt - sum(last) if last else self.prompt

    def __repr__(self) -> str:
        return f"{self.computed}/{self.prompt} (added {self.added}, last reply {self.reply})"

    def computed_only_what_it_added(self) -> None:
        # The slot holds the last prompt and all of its reply but the token sampled last
        # (never decoded), and a restore rolls back one token more: 2, and 2 for where the
        # reply's text meets the next turn's when it is read again.
        assert self.reply >= 8, f"a reply too short to tell: {self}"
        assert self.computed <= self.added + 4, self


def swap_parked_file(service: StudioService, into: str, source: str) -> None:
    """`into`'s parked file made a copy of `source`'s, its index entry saying so (size,
    digest, tokens) but for the prompt it continues (an injected fault)."""
    directory = service.parking.lot.directory
    index = json.loads((directory / INDEX_NAME).read_text())
    entries = {name: next(e for e in index["parked"] if e["file"] == file)
               for name, file in ((n, _file_of(service, n)) for n in (into, source))}
    (directory / entries[into]["file"]).write_bytes(
        (directory / entries[source]["file"]).read_bytes())
    for field in ("size", "sha256", "tokens", "checkpoints"):
        entries[into][field] = entries[source][field]
    (directory / INDEX_NAME).write_text(json.dumps(index))
    service.parking.lot._opened = False  # read the index again, as after a restart


def _file_of(service: StudioService, name: str) -> str:
    """The parked file of the session the client named `name`."""
    session = next(s for s in service.registry.sessions if s.key.endswith("\n" + name))
    return ParkKey(not_none(service.parking.identity("m", "")), session.flow,
                   session.key).file_name


async def turn(client: httpx.AsyncClient, chat: bool, session: str, n: int,
               head: str = HEAD) -> Figures:
    """Turn `n` of an agent's session: its head, the turns before (each answered with
    the client's own text), one new step; a chat, or a plain completion of the same
    conversation rendered by the client."""
    messages = [{"role": "system", "content": head}]
    for earlier in range(1, n):
        messages += [{"role": "user", "content": f"Step {earlier}: {STEP}"},
                     {"role": "assistant", "content": f"Done with step {earlier}."}]
    messages.append({"role": "user", "content": f"Step {n}: {STEP}"})
    body: dict[str, object] = {"model": "m", "max_tokens": 4, "temperature": 0,
                               "prompt_cache_key": session}
    if chat:
        route, body["messages"] = "/v1/chat/completions", messages
    else:
        route = "/v1/completions"
        body["prompt"] = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + \
            "assistant:"
    answer = await client.post(route, json=body)
    assert answer.status_code == 200, answer.text
    return Figures(answer.json()["timings"])
