"""One model across machines with llama.cpp's RPC backend, on loopback: a real worker
(the engine's own ggml-rpc-server) and a real engine that spreads the model over it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import struct
import time
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from backend.errors import RpcWorkerFailed, RpcWorkerRefused
from backend.llama.api import engine_headers
from backend.llama.engine import Engine
from backend.llama.load import LoadSettings, Snapshot, State
from backend.llama.rpc_worker import (RpcProtocol, RpcWorker, check_rpc_workers,
                                      check_worker_address, hello, insecurity_warning,
                                      protocol_of_sources, rpc_failure_reason)
from backend.llama.supervisor import Supervisor, build_command, pick_free_port
from tests.not_none import not_none

SETTINGS = LoadSettings(ctx_size=1024, parallel="1", n_gpu_layers="all", threads=1)


@pytest.fixture(scope="session")
def rpc_server_binary(engine: Engine, llama_server_binary: Path) -> Path:
    try:
        return engine.rpc_server(backends=["cpu"])
    except Exception as exc:  # noqa: BLE001 - the reason is the message
        pytest.fail(f"{exc}\nRun scripts/setup test (it builds the engine with RPC).")


@pytest.fixture
async def worker(rpc_server_binary: Path) -> AsyncIterator[RpcWorker]:
    started = await RpcWorker.start(rpc_server_binary, "127.0.0.1", pick_free_port(), 1,
                                    lambda _line: None)
    try:
        yield started
    finally:
        await started.stop()


async def test_the_tiny_model_over_a_worker_answers_exactly_as_without_it_and_its_layers_go_there(
        llama_server_binary, tiny_model, tmp_path, worker):
    async with loaded(llama_server_binary, tmp_path / "alone", tiny_model, SETTINGS) as alone:
        here = await chat(alone)
    spread = dataclasses.replace(SETTINGS, rpc=(worker.endpoint,))
    async with loaded(llama_server_binary, tmp_path / "rpc", tiny_model, spread) as over_rpc:
        there = await chat(over_rpc)
        log = Path(not_none(over_rpc.log_path)).read_text()
    assert there["content"] == here["content"] and there["tokens"] == here["tokens"] == 16
    # The engine itself says where the layers went: every layer on the worker's device,
    # with the model's weights held there, none of them on this machine's CPU.
    report = over_rpc.engine
    assert report is not None
    assert report.layers_offloaded == report.layers_total
    rpc_device = next(d for d in report.devices if d.name == "RPC0")
    assert rpc_device.description == worker.endpoint and rpc_device.model_mib > 1
    assert f"--rpc {worker.endpoint}" in log
    assert f"on RPC0 ({worker.endpoint})" in report.summary()
    assert alone.engine is not None and all(d.name == "CPU" for d in alone.engine.devices)


async def test_an_unreachable_worker_is_a_readable_load_error(llama_server_binary, tiny_model,
                                                              tmp_path):
    closed = f"127.0.0.1:{pick_free_port()}"
    supervisor = Supervisor(llama_server_binary, tmp_path, load_timeout=60, stop_timeout=5)
    spec = dataclasses.replace(SETTINGS, rpc=(closed,)).to_spec(str(tiny_model))
    with pytest.raises(RpcWorkerFailed) as caught:
        await supervisor.load(spec)
    message = str(caught.value)
    assert message.startswith(f"RPC worker {closed} cannot be reached (connection refused")
    assert "gguf-studio rpc-worker" in message
    assert supervisor.snapshot.state is State.FAILED and supervisor.snapshot.error == message
    assert supervisor.snapshot.pid is None and not supervisor.snapshot.cpu_retry_offered


async def test_a_worker_busy_with_another_engine_is_named_instead_of_a_load_that_hangs(
        llama_server_binary, tiny_model, tmp_path, worker):
    spread = dataclasses.replace(SETTINGS, rpc=(worker.endpoint,))
    async with loaded(llama_server_binary, tmp_path / "first", tiny_model, spread):
        second = Supervisor(llama_server_binary, tmp_path / "second", load_timeout=60)
        with pytest.raises(RpcWorkerFailed, match="serving another engine already"):
            await second.load(spread.to_spec(str(tiny_model)))
    # Once the first engine let it go, the worker serves the next one.
    async with loaded(llama_server_binary, tmp_path / "third", tiny_model, spread) as third:
        assert (await chat(third))["tokens"] == 16


async def test_the_busy_check_does_not_kill_a_worker_started_by_hand(rpc_server_binary,
                                                                    source_tree):
    """llama.cpp's own server dies of SIGPIPE when it answers a client that closed; the
    check resets its connection, so the worker only drops it once free."""
    port = pick_free_port()
    by_hand = await asyncio.create_subprocess_exec(
        str(rpc_server_binary), "--port", str(port), "--threads", "1",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await until_answering(f"127.0.0.1:{port}")
        async with holding(f"127.0.0.1:{port}"):
            with pytest.raises(RpcWorkerFailed, match="serving another engine"):
                await hello(f"127.0.0.1:{port}", answer_timeout=0.5)
        assert await hello(f"127.0.0.1:{port}") == protocol_of_sources(source_tree)
        assert by_hand.returncode is None
    finally:
        by_hand.kill()
        await by_hand.wait()


async def test_a_worker_outlives_a_client_that_leaves_before_its_answer(worker):
    async with holding(worker.endpoint):
        reader, writer = await asyncio.open_connection(*worker.endpoint.split(":"))
        writer.write(HELLO)
        await writer.drain()
        writer.close()  # a plain close: the worker's answer, once free, meets no one
    assert await hello(worker.endpoint) == worker.protocol
    assert worker.proc.returncode is None


async def test_a_worker_that_goes_away_fails_the_load_with_its_address(
        llama_server_binary, tiny_model, tmp_path, worker):
    spread = dataclasses.replace(SETTINGS, rpc=(worker.endpoint,))
    supervisor = Supervisor(llama_server_binary, tmp_path, load_timeout=60, stop_timeout=5,
                            max_restarts=1, restart_backoff=(0.0,))
    failed = asyncio.Event()
    supervisor.add_listener(lambda s: failed.set() if s.state is State.FAILED else None)
    try:
        ready = await supervisor.load(spread.to_spec(str(tiny_model)))
        await worker.stop()
        # The engine finds out at its next computation: the request fails, the engine
        # stops, and its restart finds no worker.
        with contextlib.suppress(httpx.HTTPError):
            await chat(ready)
        await asyncio.wait_for(failed.wait(), 60)
        error = supervisor.snapshot.error or ""
        assert f"RPC worker {worker.endpoint} cannot be reached" in error
        assert "Gave up" in error
    finally:
        await supervisor.unload()


async def test_workers_in_the_environment_are_not_added_to_a_load_that_asked_for_none(
        llama_server_binary, tiny_model, tmp_path, monkeypatch):
    """llama-server reads LLAMA_ARG_RPC as --rpc; left in, a load without workers would
    try to reach one (here a closed port, which would end the engine)."""
    monkeypatch.setenv("LLAMA_ARG_RPC", f"127.0.0.1:{pick_free_port()}")
    async with loaded(llama_server_binary, tmp_path, tiny_model, SETTINGS) as engine:
        assert (await chat(engine))["tokens"] == 16
        assert engine.engine is not None and [d.name for d in engine.engine.devices] == ["CPU"]


async def test_the_engines_own_words_for_an_unreachable_worker_are_worded_for_people(
        llama_server_binary, tiny_model, tmp_path):
    """Past the check (a worker gone between it and the load) the engine aborts; what it
    printed is what the supervisor words."""
    closed = f"127.0.0.1:{pick_free_port()}"
    spec = dataclasses.replace(SETTINGS, rpc=(closed,)).to_spec(str(tiny_model))
    proc = await asyncio.create_subprocess_exec(
        *build_command(llama_server_binary, spec, pick_free_port()),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode != 0
    lines = output.decode(errors="replace").splitlines()
    assert rpc_failure_reason(lines) == (
        f"RPC worker {closed} cannot be reached. Start `gguf-studio rpc-worker` there (with "
        "--host set to an address this machine can reach) and check that its port is open "
        "to this machine.")
    assert rpc_failure_reason(["load_tensors: loading model tensors"]) is None


async def test_a_worker_greets_with_the_protocol_of_the_sources_and_other_versions_are_refused(
        worker, source_tree):
    ours = protocol_of_sources(source_tree)
    assert ours is not None and ours.major >= 1
    assert worker.protocol == ours == await hello(worker.endpoint)
    await check_rpc_workers([worker.endpoint], ours)
    newer = RpcProtocol(ours.major + 1, 0)
    with pytest.raises(RpcWorkerFailed, match=f"speaks RPC protocol {ours}, this engine {newer}"):
        await check_rpc_workers([worker.endpoint], newer)
    # Its output reaches the user: the three greetings above, not the one of `start`.
    await until(lambda: worker.output.count("Accepted client connection") == 3)
    assert any(line.startswith("Starting RPC server") for line in worker.output)


async def test_a_port_in_use_is_refused_before_the_server_starts(rpc_server_binary):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RpcWorkerRefused, match=f"Cannot listen on 127.0.0.1:{port}: the port "
                                                   "is in use"):
            await RpcWorker.start(rpc_server_binary, "127.0.0.1", port, 1, lambda _: None)


async def test_something_else_on_the_port_is_not_taken_for_a_worker():
    async def close_at_once(reader, writer):
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        with pytest.raises(RpcWorkerFailed, match="closed the connection without answering"):
            await hello(f"127.0.0.1:{port}")


def test_a_worker_listens_beyond_loopback_only_when_the_risk_is_accepted():
    check_worker_address("127.0.0.1", 50052, False)
    check_worker_address("127.0.0.2", 50052, False)
    with pytest.raises(RpcWorkerRefused, match="--i-understand-rpc-is-insecure"):
        check_worker_address("0.0.0.0", 50052, False)
    with pytest.raises(RpcWorkerRefused, match="--i-understand-rpc-is-insecure"):
        check_worker_address("192.168.1.20", 50052, False)
    check_worker_address("192.168.1.20", 50052, True)
    with pytest.raises(RpcWorkerRefused, match="IPv4 address only"):
        check_worker_address("gpu-box.lan", 50052, True)
    with pytest.raises(RpcWorkerRefused, match="from 1 to 65535"):
        check_worker_address("127.0.0.1", 0, False)
    assert "this machine only" in insecurity_warning("127.0.0.1", 50052)
    wide = insecurity_warning("0.0.0.0", 50052)
    assert "every machine that can reach 0.0.0.0:50052" in wide
    assert "trusted wired network only" in wide


HELLO = struct.pack("<BQ", 14, 24) + bytes(24)


@contextlib.asynccontextmanager
async def holding(endpoint: str) -> AsyncIterator[None]:
    """A client that keeps the worker busy, as an engine does."""
    reader, writer = await asyncio.open_connection(*endpoint.split(":"))
    writer.write(HELLO)
    await reader.readexactly(36)
    try:
        yield
    finally:
        writer.close()


async def until_answering(endpoint: str) -> None:
    async def answered() -> bool:
        try:
            await hello(endpoint)
            return True
        except RpcWorkerFailed:
            return False
    deadline = time.monotonic() + 30
    while not await answered():
        assert time.monotonic() < deadline, "the RPC server never answered"
        await asyncio.sleep(0.05)


async def until(condition, timeout: float = 10.0) -> None:
    """Wait for output a process writes at its own pace (the server's pipe)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def loaded(binary: Path, log_dir: Path, model: Path,
                 settings: LoadSettings) -> AsyncIterator[Snapshot]:
    supervisor = Supervisor(binary, log_dir, load_timeout=120, stop_timeout=5)
    try:
        yield await supervisor.load(settings.to_spec(str(model)))
    finally:
        await supervisor.unload()


async def chat(engine: Snapshot) -> dict:
    assert engine.serving is not None
    async with httpx.AsyncClient(headers=engine_headers(engine.serving.api_key),
                                 timeout=120) as client:
        answer = await client.post(f"{engine.serving.base_url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Say something."}],
            "temperature": 0, "seed": 42, "max_tokens": 16})
    answer.raise_for_status()
    body = answer.json()
    return {"content": body["choices"][0]["message"]["content"],
            "tokens": body["usage"]["completion_tokens"]}
