"""The backend's event loop: uvloop where installed, asyncio's when ruled out, and the
window's backend thread runs the real engine and the port on it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from backend import event_loop
from backend.llama.load import LoadSettings, State
from backend.app.backend_thread import BackendThread
from backend.app.service import StudioService
from backend.settings import Settings

uvloop = pytest.importorskip("uvloop")


def test_uvloop_is_chosen_where_installed_and_asyncio_when_ruled_out(monkeypatch):
    monkeypatch.delenv(event_loop.ENV, raising=False)
    loop = event_loop.new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    loop = event_loop.new_event_loop()
    try:
        assert not isinstance(loop, uvloop.Loop)
        assert isinstance(loop, asyncio.AbstractEventLoop)
    finally:
        loop.close()


def test_serve_runs_on_uvloop_and_ruled_out_on_asyncio(tmp_path: Path):
    probe = ("import asyncio, sys\n"
             "from backend import event_loop\n"
             "async def main():\n"
             "    return type(asyncio.get_running_loop()).__module__\n"
             "print(event_loop.run(main()))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    chosen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=60, check=True).stdout.strip()
    ruled_out = subprocess.run([sys.executable, "-c", probe],
                               env={**env, event_loop.ENV: "asyncio"}, capture_output=True,
                               text=True, timeout=60, check=True).stdout.strip()
    assert chosen.startswith("uvloop")
    assert ruled_out.startswith("asyncio")


def test_the_window_backend_thread_loads_a_real_engine_and_streams_on_uvloop(
        tmp_path: Path, llama_server_binary: Path, tiny_model: Path):
    # The window's loop lives in a thread of its own: the engine is a child process
    # started and watched from that thread, which uvloop must handle like asyncio does.
    thread = BackendThread()
    assert isinstance(thread.loop, uvloop.Loop)
    settings = Settings(port=0, llama_server=str(llama_server_binary), load_timeout=60)
    service = StudioService(settings, log_dir=tmp_path / "logs")
    try:
        thread.submit(service.start_gateway()).result(30)
        spec = LoadSettings(parallel="2", ctx_size=4096).to_spec(str(tiny_model))
        snapshot = thread.submit(service.load(spec)).result(90)
        assert snapshot.state is State.READY
        body = {"model": "tiny", "stream": True, "max_tokens": 8, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Hello"}]}
        with httpx.Client(base_url=f"http://127.0.0.1:{service.gateway_port}",
                          timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = [line for line in response.iter_lines() if line]
        assert response.status_code == 200
        assert lines[-1] == "data: [DONE]"
        assert sum('"content":"' in line for line in lines) >= 1
        engine_pid = snapshot.pid
        assert engine_pid
        thread.submit(service.close()).result(60)
        assert service.snapshot().state is State.STOPPED
        with pytest.raises(ProcessLookupError):  # ended and reaped by the loop's watcher
            os.kill(engine_pid, 0)
    finally:
        if not thread.loop.is_closed():
            thread.submit(service.close()).result(60)
        thread.stop()


async def test_the_async_tests_run_on_the_loop_the_product_runs_on():
    """tests/conftest.py gives pytest-asyncio the product's loop factory."""
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
