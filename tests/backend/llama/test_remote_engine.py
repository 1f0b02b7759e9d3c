"""Engines on other machines: a plain llama-server or another GGUF Studio port, watched.

Real engines throughout (llama-server on the generated tiny model, `gguf-studio serve`
as a real process); the fake upstream only where a real engine cannot give the timing
(a restart no health check sees).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

import httpx
import pytest

from backend.app.service import StudioService
from backend.errors import SettingsError
from backend.llama.api import UpstreamModel
from backend.llama.kv_capacity import KvCapacity, KvLayout
from backend.llama.load import Snapshot, State
from backend.llama.remote_engine import RemoteEngine, UpstreamKind, normalise_base_url
from backend.llama.supervisor import pick_free_port
from backend.settings import Settings
from tests.fake_upstream import FakeUpstream
from tests.model_factory import write_tiny_model
from tests.not_none import not_none

ROOT = Path(__file__).resolve().parents[3]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}  # no max_tokens, as Codex


def start_llama_server(binary: Path, model: Path, port: int, parallel: int, ctx: int = 2048,
                       extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
         "-np", str(parallel), "-c", str(ctx), "--alias", "elsewhere", "--no-webui", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


class Watch:
    """Every snapshot a backend publishes, and a wait for one that matches."""

    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []
        self._changed = asyncio.Event()

    def __call__(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)
        self._changed.set()

    async def until(self, predicate: Callable[[Snapshot], bool], timeout: float = 60) -> Snapshot:
        async def wait() -> Snapshot:
            while not (self.snapshots and predicate(self.snapshots[-1])):
                self._changed.clear()
                await self._changed.wait()
            return self.snapshots[-1]
        return await asyncio.wait_for(wait(), timeout)


def ready(s: Snapshot) -> bool:
    return s.state is State.READY


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory, vocab_path: Path) -> Path:
    """The tiny model trained on 32,768 tokens, so that no slot is capped by training."""
    return write_tiny_model(tmp_path_factory.mktemp("long") / "long.gguf", vocab_path,
                            context_length=32768)


@pytest.fixture
async def attached(tmp_path, llama_server_binary, tiny_model):
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=3)
    service = StudioService(Settings(port=0), log_dir=tmp_path / "logs")
    watch = Watch()
    service.add_listener(watch)
    await service.start_gateway()
    await service.attach_upstream(f"http://127.0.0.1:{port}/v1/")
    try:
        yield service, watch.until, port, engine
    finally:
        await service.close()
        stop(engine)


# --- a plain llama-server -------------------------------------------------------------


async def test_attached_engine_is_served_with_its_slots_after_it_turns_healthy(attached):
    service, until, port, _engine = attached
    ready_now = await until(ready)
    assert ready_now.serving.slots == 3
    # -np 3 -c 2048: 768 tokens per slot; nobody said whether the cache is shared, so the
    # port assumes one pool of one slot's context (never more than the engine has) ...
    assert ready_now.serving.kv == KvCapacity(768, 768, unified=True)
    assert service.registry.kv_capacity == 768
    # ... and says what that costs, for the log and the window.
    assert ready_now.serving.kv_note == ("KV layout unknown: assuming one shared pool of 768 tokens; "
                                 "this limits concurrency — state split or unified for this upstream.")
    assert ready_now.model_id == "elsewhere"
    assert service.registry.current.capacity == 3
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}") as client:
        answer = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["finish_reason"] == "length"


async def test_an_attached_engine_that_goes_away_and_comes_back_is_followed(
        attached, llama_server_binary, tiny_model):
    service, until, port, engine = attached
    await until(ready)
    stop(engine)
    gone = await until(lambda s: s.state is not State.READY)
    assert gone.restarting and gone.serving is None
    assert gone.error == "The upstream does not answer."
    assert service.registry.current is None
    again = start_llama_server(llama_server_binary, tiny_model, port, parallel=2)
    try:
        back = await until(ready)
        assert back.serving.slots == 2  # slots read again
        assert back.serving.kv == KvCapacity(1024, 1024, unified=True)  # and the cache
        assert back.error is None
        assert not_none(service.registry.current).capacity == 2
    finally:
        stop(again)


async def test_props_and_slots_cannot_tell_a_split_cache_from_a_unified_one(
        llama_server_binary, long_model):
    # What the issue says, measured on the real engine: -np 4 -c 16384 gives 4 x 4,096
    # split and 4 x 16,384 unified; and a unified pool of 4,096 (-c 4096 --kv-unified)
    # reads exactly like the split 16,384, so no field can tell the two apart.
    read = {}
    for name, extra in [("split 16k", ("-c", "16384")), ("unified 16k", ("-c", "16384", "--kv-unified")),
                        ("unified 4k", ("-c", "4096", "--kv-unified"))]:
        port = pick_free_port()
        engine = subprocess.Popen([str(llama_server_binary), "-m", str(long_model), "--host", "127.0.0.1",
                                   "--port", str(port), "-np", "4", "--no-webui", *extra],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as client:
                await _until_healthy(client)
                props = (await client.get("/props")).json()
                slots = (await client.get("/slots")).json()
        finally:
            stop(engine)
        props.pop("media_marker")  # a random marker per start
        read[name] = props, slots
    assert [s["n_ctx"] for s in read["split 16k"][1]] == [4096] * 4
    assert [s["n_ctx"] for s in read["unified 16k"][1]] == [16384] * 4
    assert read["split 16k"][0]["default_generation_settings"]["n_ctx"] == 4096
    assert read["unified 16k"][0]["default_generation_settings"]["n_ctx"] == 16384
    assert read["split 16k"] == read["unified 4k"]


async def test_a_split_statement_lets_four_short_chats_start_together_through_serve_upstream(
        llama_server_binary, long_model, tmp_path):
    # The case: `llama-server -np 4 -c 16384`, chats without max_tokens; before,
    # they got their first tokens at 0.03, 9.0, 9.4 and 14.0 s.
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, long_model, port, parallel=4, ctx=16384)
    try:
        async with serve_upstream(tmp_path, f"http://127.0.0.1:{port}", "--upstream-kv", "split") as (
                url, ready_line):
            assert ready_line == ("[ready] elsewhere: effective parallel slots 4, context 4096 per "
                                  "slot; KV cache: up to 4 requests at once; each slot has its own "
                                  "4,096 tokens")
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                chats = [Chat(client) for _ in range(4)]
                try:
                    await asyncio.wait_for(asyncio.gather(*(c.first_token.wait() for c in chats)), 60)
                    assert not any(c.ended for c in chats)  # all four began; none had to end first
                    health = (await client.get("/health")).json()
                    assert (health["active"], health["waiting"]) == (4, 0)
                finally:
                    for chat in chats:
                        await chat.close()
    finally:
        stop(engine)


async def test_without_a_statement_the_safe_assumption_holds_chats_back_and_says_so(
        llama_server_binary, long_model, tmp_path):
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, long_model, port, parallel=4, ctx=16384)
    try:
        async with serve_upstream(tmp_path, f"http://127.0.0.1:{port}") as (url, ready_line):
            assert "one shared pool of 4,096 tokens" in ready_line
            assert "KV layout unknown: assuming one shared pool of 4,096 tokens; this limits " \
                   "concurrency — state split or unified for this upstream. " \
                   "(--upstream-kv split|unified)" in ready_line
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                chats = [Chat(client) for _ in range(4)]
                try:
                    # Each reserves its prompt and 2,048 output tokens: one fits a pool of 4,096.
                    await _until_health(client, lambda h: (h["active"], h["waiting"]) == (1, 3))
                finally:
                    for chat in chats:
                        await chat.close()
    finally:
        stop(engine)


async def test_a_wrong_key_keeps_the_engine_out_and_says_why(tmp_path, llama_server_binary, tiny_model):
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=2,
                                extra=("--api-key", "the-right-one"))
    remote = RemoteEngine(f"http://127.0.0.1:{port}", api_key="a-wrong-one", interval=0.05)
    watch = Watch()
    remote.add_listener(watch)
    try:
        await remote.start()
        refused = await watch.until(lambda s: s.error is not None and "key" in s.error)
        assert refused.state is State.STARTING and refused.serving is None
        assert refused.error == "The upstream refused the API key: give the key it requires."
    finally:
        await remote.close()
        stop(engine)


async def test_an_attached_engine_that_requires_a_key_is_served_with_it(
        tmp_path, llama_server_binary, tiny_model):
    port = pick_free_port()
    key_file = tmp_path / "upstream.key"
    key_file.write_text("upstream-secret\n")
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=2,
                                extra=("--api-key-file", str(key_file)))
    service = StudioService(Settings(port=0), log_dir=tmp_path / "logs")
    watch = Watch()
    service.add_listener(watch)
    try:
        await service.start_gateway()
        await service.attach_upstream(f"http://127.0.0.1:{port}", api_key="upstream-secret",
                                      kv_layout=KvLayout.SPLIT)
        ready_now = await watch.until(ready)
        assert ready_now.serving is not None
        assert ready_now.serving.slots == 2  # /props needs the key
        assert ready_now.serving.kv == KvCapacity(2048, 1024, unified=False) and ready_now.serving.kv_note is None
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}") as client:
            answer = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        await service.close()
        stop(engine)


async def test_a_restart_between_two_health_checks_is_caught_by_the_periodic_read():
    # Fake upstream: a restart with other settings that no health check sees is timing a
    # real engine cannot give.
    async with FakeUpstream(slots=2, n_ctx=1024) as fake:
        remote = RemoteEngine(fake.base_url, kv_layout=KvLayout.SPLIT, interval=0.02,
                              reread_interval=0.3)
        watch = Watch()
        remote.add_listener(watch)
        try:
            await remote.start()
            first = await watch.until(ready)
            assert first.serving is not None
            assert first.serving.kv == KvCapacity(2048, 1024, unified=False)
            assert first.model_id == "fake-model" and remote.kind is UpstreamKind.LLAMA_SERVER
            fake.slots, fake.n_ctx = 4, 2048  # "restarted" as -np 4 -c 8192
            again = await watch.until(lambda s: not_none(s.serving).slots == 4, timeout=10)
            assert again.serving is not None
            assert again.serving.kv == KvCapacity(8192, 2048, unified=False)
            assert all(ready(s) for s in watch.snapshots[watch.snapshots.index(first):])
        finally:
            await remote.close()


async def test_a_llama_server_without_an_alias_is_named_by_its_file_not_its_path(
        llama_server_binary, tiny_model):
    port = pick_free_port()
    engine = subprocess.Popen([str(llama_server_binary), "-m", str(tiny_model), "--host", "127.0.0.1",
                               "--port", str(port), "-np", "1", "-c", "1024", "--no-webui"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    remote = RemoteEngine(f"http://127.0.0.1:{port}", interval=0.05)
    watch = Watch()
    remote.add_listener(watch)
    try:
        await remote.start()
        served = await watch.until(ready)
        assert served.model_id == "tiny"
        assert served.serving is not None
        assert served.serving.kv_note is None  # one slot: split or unified are the same
    finally:
        await remote.close()
        stop(engine)


# --- another GGUF Studio port -------------------------------------------------------------


async def test_a_gguf_studio_upstreams_exact_cache_and_models_are_read_from_it(
        tmp_path, llama_server_binary, tiny_model):
    port = pick_free_port()
    studio = start_studio(tmp_path, llama_server_binary, tiny_model, port)
    service = StudioService(Settings(port=0), log_dir=tmp_path / "downstream-logs")
    watch = Watch()
    service.add_listener(watch)
    try:
        await service.start_gateway()
        await service.attach_upstream(f"http://127.0.0.1:{port}/v1", api_key="studio-key-0123456789")
        served = await watch.until(ready)
        # -np 2 -c 4096 split: 2,048 per slot, 4,096 in all; read exactly, not assumed.
        assert served.serving is not None
        assert served.serving.kv == KvCapacity(4096, 2048, unified=False) and served.serving.kv_note is None
        assert served.serving.slots == 2 and served.serving.context_length == 2048
        assert served.model_id == "tiny"
        assert served.serving.upstream_models == (UpstreamModel("tiny", 2048, 2048),)
        queue = not_none(service.registry.current)
        assert queue.kv is not None and queue.kv.total == 4096
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}") as client:
            answer = await client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
    finally:
        await service.close()
        end_studio(studio)


async def test_a_gguf_studio_upstream_that_stops_and_starts_again_leaves_and_rejoins(
        tmp_path, llama_server_binary, tiny_model):
    port = pick_free_port()
    studio = start_studio(tmp_path, llama_server_binary, tiny_model, port)
    remote = RemoteEngine(f"http://127.0.0.1:{port}", api_key="studio-key-0123456789", interval=0.05)
    watch = Watch()
    remote.add_listener(watch)
    try:
        await remote.start()
        await watch.until(ready)
        assert remote.kind is UpstreamKind.GGUF_STUDIO
        studio.kill()  # SIGKILL: its engine goes with it (the supervisor's death signal)
        studio.wait()
        gone = await watch.until(lambda s: not ready(s))
        assert gone.restarting and gone.serving is None
        studio = start_studio(tmp_path, llama_server_binary, tiny_model, port, parallel=3)
        # Its port opens before its model is loaded: until that is ready, at most one
        # request at a time goes there (it waits there for the load), since its slots and
        # cache are not known yet.
        back = await watch.until(lambda s: ready(s) and not_none(s.serving).kv is not None)
        assert back.serving is not None
        assert back.serving.slots == 3 and back.serving.kv == KvCapacity(6144, 2048, unified=False)
        between = watch.snapshots[watch.snapshots.index(gone):-1]
        assert all(s.serving is None or s.serving.slots == 1 for s in between)
    finally:
        await remote.close()
        end_studio(studio)


# --- the URL ----------------------------------------------------------------------------


@pytest.mark.parametrize("given, expected", [
    ("http://10.0.0.5:8080", "http://10.0.0.5:8080"),
    ("http://10.0.0.5:8080/", "http://10.0.0.5:8080"),
    ("http://10.0.0.5:8080/v1", "http://10.0.0.5:8080"),
    (" https://gpu-box/llama/v1/ ", "https://gpu-box/llama"),
])
def test_upstream_urls_are_normalised_to_the_servers_root(given, expected):
    assert normalise_base_url(given) == expected


@pytest.mark.parametrize("bad", ["10.0.0.5:8080", "ftp://host", "http://"])
def test_an_unusable_upstream_url_is_refused_clearly(bad):
    with pytest.raises(SettingsError, match="http"):
        normalise_base_url(bad)


# --- helpers ------------------------------------------------------------------------------


class Chat:
    """One streamed chat through the port, read until closed."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.first_token = asyncio.Event()
        self.ended = False
        self._task = asyncio.create_task(self._run(client))

    async def _run(self, client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    self.ended = True
                elif line.startswith("data: ") and _content(line):
                    self.first_token.set()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _content(line: str) -> str:
    choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


@asynccontextmanager
async def serve_upstream(tmp_path: Path, upstream: str, *args: str) -> AsyncIterator[tuple[str, str]]:
    """`gguf-studio serve --upstream URL ARGS` as a user runs it: its port's URL and what
    it prints when the upstream is ready (a note joined to that line)."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "serve", "--upstream", upstream, "--port", "0", *args,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    stdout = proc.stdout
    try:
        url, ready_line = "", ""

        async def read_until_ready() -> None:
            nonlocal url, ready_line
            async for raw in stdout:
                line = raw.decode().rstrip("\n")
                if line.strip().startswith("http://") and not url:
                    url = line.strip().removesuffix("/v1")
                if line.startswith("[ready]"):
                    ready_line = line
                    return
            raise AssertionError("serve ended before its upstream was ready")

        await asyncio.wait_for(read_until_ready(), 60)
        # A note comes as a second, indented line of the same print.
        note = await _next_line(proc, 1.0)
        if note is not None and note.startswith("  "):
            ready_line += " " + note.strip()
        yield url, ready_line
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


async def _next_line(proc: asyncio.subprocess.Process, timeout: float) -> str | None:
    assert proc.stdout is not None
    try:
        return (await asyncio.wait_for(proc.stdout.readline(), timeout)).decode().rstrip("\n")
    except asyncio.TimeoutError:
        return None


def start_studio(tmp_path: Path, binary: Path, model: Path, port: int, parallel: int = 2,
                 extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`gguf-studio serve --model tiny.gguf` on `port`, split 2,048 tokens per slot, with
    a key of its own; `extra`: more of `serve`'s arguments (other models)."""
    key_file = tmp_path / "studio.key"
    key_file.write_text("studio-key-0123456789\n")
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "studio-config"),
               XDG_STATE_HOME=str(tmp_path / "studio-state"), XDG_CACHE_HOME=str(tmp_path / "studio-cache"))
    return subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "serve", "--model", str(model), "--port", str(port),
         "--parallel", str(parallel), "--ctx-size", str(2048 * parallel), "--llama-server", str(binary),
         "--api-key-file", str(key_file), *extra],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def end_studio(studio: subprocess.Popen) -> None:
    if studio.poll() is None:
        studio.send_signal(signal.SIGINT)
        try:
            studio.wait(30)
        except subprocess.TimeoutExpired:
            studio.kill()
            studio.wait()


async def _until_healthy(client: httpx.AsyncClient, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the engine never turned healthy"
        await asyncio.sleep(0.05)


async def _until_health(client: httpx.AsyncClient, predicate: Callable[[dict], bool],
                        timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = (await client.get("/health")).json()
        if predicate(health):
            return health
        assert time.monotonic() < deadline, f"/health never matched; last {health}"
        await asyncio.sleep(0.05)
