"""The supervisor against the real llama-server and the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from backend.llama.api import engine_headers
from backend.errors import EngineExitedDuringLoad, LoadSuperseded, LoadTimedOut, SettingsError
from backend.llama.engine import engine_patches
from backend.llama.load import LoadSettings, LoadSpec, Snapshot, State
from backend.llama.patches import LLAMA_CPP_PATCHES
from backend.llama.supervisor import Supervisor, pick_free_port
from tests.model_factory import write_not_gguf, write_truncated_copy
from tests.not_none import not_none


@pytest.fixture
async def supervisor(llama_server_binary: Path, tmp_path: Path):
    sup = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=60,
                     restart_backoff=(0.1,), stop_timeout=5)
    yield sup
    await sup.unload()  # no test leaves a child behind, whatever it asserted


class Recorder:
    def __init__(self, sup: Supervisor) -> None:
        self.snapshots: list[Snapshot] = []
        self._changed = asyncio.Event()
        sup.add_listener(self._on)

    def _on(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)
        self._changed.set()

    @property
    def states(self) -> list[State]:
        out: list[State] = []
        for s in self.snapshots:
            if not out or out[-1] is not s.state:
                out.append(s.state)
        return out

    async def until(self, predicate, timeout: float = 60.0) -> Snapshot:
        async def wait() -> Snapshot:
            while True:
                for s in reversed(self.snapshots):
                    if predicate(s):
                        return s
                    break
                self._changed.clear()
                await self._changed.wait()
        return await asyncio.wait_for(wait(), timeout)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def props(snapshot: Snapshot) -> dict:
    """The engine's /props, asked with the key the engine's port requires."""
    assert snapshot.serving is not None
    async with httpx.AsyncClient(headers=engine_headers(snapshot.serving.api_key)) as client:
        return (await client.get(f"{snapshot.serving.base_url}/props")).raise_for_status().json()


async def test_load_reaches_ready_with_three_slots_as_read_from_the_server(supervisor, tiny_model):
    rec = Recorder(supervisor)
    wanted = LoadSettings(parallel="3", ctx_size=4096)
    snapshot = await supervisor.load(wanted.to_spec(str(tiny_model)))
    try:
        assert snapshot.state is State.READY
        assert snapshot.requested == wanted  # what was asked, next to what the engine did
        assert snapshot.serving.slots == 3
        assert (await props(snapshot))["total_slots"] == 3
        assert snapshot.serving.base_url.startswith("http://127.0.0.1:")
        assert snapshot.model_id == "tiny"
        assert rec.states == [State.STARTING, State.READY]
    finally:
        await supervisor.unload()


async def test_parallel_auto_reports_the_slot_count_the_server_chose(supervisor, tiny_model):
    snapshot = await supervisor.load(LoadSettings(parallel="auto", ctx_size=4096).to_spec(str(tiny_model)))
    try:
        chosen = (await props(snapshot))["total_slots"]
        assert chosen >= 1
        assert snapshot.serving.slots == chosen
    finally:
        await supervisor.unload()


async def test_an_engine_saving_slots_says_whether_it_keeps_their_context_checkpoints(
        llama_server_binary, tiny_model, tmp_path):
    """Asked of the engine itself: one built with our patch keeps them (parked prefixes
    of sliding-window and hybrid models restore), another does not; the file the question
    saved is gone."""
    slots = tmp_path / "slots"
    slots.mkdir()
    sup = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=60, stop_timeout=5,
                     slot_save_dir=lambda: slots)
    try:
        serving = not_none((await sup.load(LoadSpec(str(tiny_model),
                                                    LoadSettings(parallel="2")))).serving)
    finally:
        await sup.unload()
    patched = LLAMA_CPP_PATCHES[0].name in engine_patches(llama_server_binary)
    assert serving.parks_checkpoints is patched
    assert list(slots.iterdir()) == []
    # Without a slot directory nothing is saved, nor asked.
    async with running_without_slots(llama_server_binary, tiny_model, tmp_path) as snapshot:
        assert not_none(snapshot.serving).parks_checkpoints is None


@contextlib.asynccontextmanager
async def running_without_slots(binary: Path, model: Path, tmp_path: Path
                                ) -> AsyncIterator[Snapshot]:
    sup = Supervisor(binary, tmp_path / "logs-2", load_timeout=60, stop_timeout=5)
    try:
        yield await sup.load(LoadSpec(str(model), LoadSettings(parallel="2")))
    finally:
        await sup.unload()


async def test_unload_stops_the_child_and_resets_slots(supervisor, tiny_model):
    snapshot = await supervisor.load(LoadSettings(parallel="2", ctx_size=2048).to_spec(str(tiny_model)))
    rec = Recorder(supervisor)
    await supervisor.unload()
    assert supervisor.snapshot.state is State.STOPPED
    assert supervisor.snapshot.serving is None
    assert supervisor.snapshot.serving is None
    assert not pid_alive(snapshot.pid)
    assert rec.states == [State.STOPPING, State.STOPPED]


async def test_killed_child_is_restarted_and_slots_are_read_again(supervisor, tiny_model):
    first = await supervisor.load(LoadSettings(parallel="2", ctx_size=2048).to_spec(str(tiny_model)))
    rec = Recorder(supervisor)
    try:
        os.kill(first.pid, signal.SIGKILL)
        crashed = await rec.until(lambda s: s.state is State.STARTING)
        assert crashed.serving is None
        assert crashed.restarting
        again = await rec.until(lambda s: s.state is State.READY)
        assert again.restarts == 1
        assert again.pid != first.pid
        assert again.serving is not None
        assert again.serving.base_url != first.serving.base_url  # a new port, so a new admission queue
        assert again.serving.slots == 2
        assert "killed by SIGKILL" in (crashed.error or "")
    finally:
        await supervisor.unload()


class SteppedClock:
    """time.monotonic plus a jump we choose: stands for minutes of engine uptime between
    crashes without waiting for them (the restarts and the kills themselves are real)."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skipped


async def crash_when_ready(rec: Recorder, sup: Supervisor, seen: set[int]) -> None:
    ready = await rec.until(lambda s: s.state is State.READY and s.pid not in seen)
    assert ready.pid is not None
    seen.add(ready.pid)
    os.kill(ready.pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def crashed_three_times(binary: Path, model: Path, log_dir: Path, *, uptime: float,
                              max_restarts: int) -> AsyncIterator[tuple[Recorder, set[int]]]:
    """A supervised engine killed three times, each after `uptime` seconds of (skipped)
    uptime, under a 300 s restart window; yields what was heard and the killed pids."""
    clock = SteppedClock()
    sup = Supervisor(binary, log_dir, load_timeout=60, restart_backoff=(0.0,),
                     max_restarts=max_restarts, restart_window=300, clock=clock)
    rec = Recorder(sup)
    seen: set[int] = set()
    try:
        await sup.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(model)))
        for _ in range(3):
            await crash_when_ready(rec, sup, seen)
            await rec.until(lambda s: s.state is not State.READY)
            clock.skipped += uptime
        yield rec, seen
    finally:
        await sup.unload()


async def test_an_engine_crashing_after_each_minute_of_work_is_given_up_within_the_window(
        llama_server_binary, tiny_model, tmp_path):
    """Each crash comes 61 s of uptime after the last (a request that kills the engine,
    sent again and again): the old streak, reset after 30 s of uptime, reloaded forever."""
    async with crashed_three_times(llama_server_binary, tiny_model, tmp_path / "logs",
                                   uptime=61, max_restarts=2) as (rec, _):
        failed = await rec.until(lambda s: s.state is State.FAILED)
        assert failed.error is not None
        assert "Gave up: it had to be restarted 2 times within 300 seconds (at most 2)" in failed.error
        assert "killed by SIGKILL" in failed.error
        assert failed.serving is None and failed.pid is None
        assert llama_server_children() == []
        assert [s.error for s in rec.snapshots if s.error and "Restarting (1 of at most 2" in s.error]


async def test_crashes_further_apart_than_the_window_keep_being_restarted(
        llama_server_binary, tiny_model, tmp_path):
    async with crashed_three_times(llama_server_binary, tiny_model, tmp_path / "logs",
                                   uptime=301, max_restarts=1) as (rec, seen):
        back = await rec.until(lambda s: s.state is State.READY and s.pid not in seen)
        assert back.restarts == 3


async def test_an_engine_that_stops_answering_is_killed_and_replaced(
        llama_server_binary, tiny_model, tmp_path):
    sup = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=60, restart_backoff=(0.0,),
                     health_interval=0.2, health_timeout=0.5, health_failures=2)
    rec = Recorder(sup)
    first = await sup.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
    assert first.pid is not None
    try:
        os.kill(first.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        noticed = await rec.until(lambda s: s.state is not State.READY, timeout=30)
        assert noticed.error is not None
        # Two checks of at most 0.2 s wait + 0.5 s timeout each, plus scheduling slack.
        assert time.monotonic() - stopped_at < 2 * (0.2 + 0.5) + 3.0
        assert "stopped answering" in noticed.error
        assert not pid_alive(first.pid)
        again = await rec.until(lambda s: s.state is State.READY)
        assert again.pid != first.pid and again.restarts == 1
        assert (await props(again))["total_slots"] == 1
        assert llama_server_children() == [again.pid]
    finally:
        if pid_alive(first.pid):
            os.kill(first.pid, signal.SIGKILL)
        await sup.unload()


@pytest.mark.parametrize("breaker", [write_truncated_copy, "not_gguf"])
async def test_broken_model_fails_with_a_readable_reason(supervisor, tiny_model, tmp_path, breaker):
    bad = tmp_path / "broken.gguf"
    if breaker == "not_gguf":
        write_not_gguf(bad)
    else:
        breaker(tiny_model, bad)
    rec = Recorder(supervisor)
    with pytest.raises(EngineExitedDuringLoad) as caught:
        await supervisor.load(LoadSettings(parallel="1").to_spec(str(bad)))
    message = str(caught.value)
    assert message.startswith("llama-server exited while loading the model")
    assert "Traceback" not in message
    assert caught.value.log_tail  # the log's last lines travel with the error
    assert supervisor.snapshot.state is State.FAILED
    assert supervisor.snapshot.error == message
    assert rec.states == [State.STARTING, State.FAILED]


async def test_occupied_port_is_skipped_for_a_fresh_one(llama_server_binary, tiny_model, tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        ports = iter([taken])
        sup = Supervisor(llama_server_binary, tmp_path / "logs",
                         port_picker=lambda: next(ports, None) or pick_free_port())
        snapshot = await sup.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
        assert snapshot.serving is not None
        try:
            assert snapshot.state is State.READY
            assert not snapshot.serving.base_url.endswith(f":{taken}")
        finally:
            await sup.unload()


async def test_load_timeout_fails_and_leaves_no_child(llama_server_binary, tiny_model, tmp_path):
    sup = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=0.01)
    rec = Recorder(sup)
    with pytest.raises(LoadTimedOut):
        await sup.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
    pid = next(s.pid for s in rec.snapshots if s.pid)
    assert not pid_alive(pid)
    assert sup.snapshot.state is State.FAILED


async def test_unload_during_load_supersedes_it(supervisor, tiny_model):
    rec = Recorder(supervisor)
    load = asyncio.create_task(supervisor.load(LoadSettings(parallel="1").to_spec(str(tiny_model))))
    started = await rec.until(lambda s: s.pid is not None)
    assert started.pid is not None
    await supervisor.unload()
    with pytest.raises(LoadSuperseded):
        await load
    assert supervisor.snapshot.state is State.STOPPED
    assert not pid_alive(started.pid)


async def test_new_load_stops_the_old_one_first(supervisor, tiny_model):
    first = await supervisor.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
    second = await supervisor.load(LoadSettings(parallel="2", ctx_size=1024).to_spec(str(tiny_model)))
    try:
        assert not pid_alive(first.pid)
        assert second.serving.slots == 2
    finally:
        await supervisor.unload()


async def test_log_file_and_tail_hold_the_servers_output(supervisor, tiny_model):
    snapshot = await supervisor.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
    await supervisor.unload()
    text = Path(snapshot.log_path).read_text()
    assert "--parallel 1" in text.splitlines()[0]
    assert any("server is listening" in line or "listening" in line for line in supervisor.log_tail())


async def test_sigterm_is_followed_by_sigkill_when_ignored(tmp_path, tiny_model):
    """A fake engine that ignores SIGTERM (a real one cannot be made to, deterministically)."""
    fake = tmp_path / "stubborn-llama-server"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, signal, sys
        from http.server import BaseHTTPRequestHandler, HTTPServer
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        port = int(sys.argv[sys.argv.index("--port") + 1])
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({{"status": "ok", "total_slots": 1}}).encode()
                self.send_response(200); self.send_header("Content-Length", str(len(body)))
                self.end_headers(); self.wfile.write(body)
            def log_message(self, *a): pass
        HTTPServer(("127.0.0.1", port), H).serve_forever()
        """))
    fake.chmod(0o755)
    sup = Supervisor(fake, tmp_path / "logs", stop_timeout=0.5)
    snapshot = await sup.load(LoadSettings().to_spec(str(tiny_model)))
    assert snapshot.pid is not None
    started = time.monotonic()
    await sup.unload()
    assert not pid_alive(snapshot.pid)
    assert time.monotonic() - started >= 0.5  # it waited for SIGTERM before killing


def test_extra_arguments_may_not_override_owned_flags(tiny_model):
    with pytest.raises(SettingsError, match="--port"):
        LoadSettings(extra_args=("--port", "80")).to_spec(str(tiny_model))
    with pytest.raises(SettingsError, match="positive"):
        LoadSettings(parallel="0").to_spec(str(tiny_model))


def test_child_dies_with_the_app_even_when_the_app_is_killed(llama_server_binary, tiny_model, tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, sys
        from backend.llama.load import LoadSettings, LoadSpec
        from backend.llama.supervisor import Supervisor
        async def main():
            sup = Supervisor({str(llama_server_binary)!r}, {str(tmp_path / 'logs')!r})
            snap = await sup.load(LoadSettings(parallel="1", ctx_size=1024).to_spec({str(tiny_model)!r}))
            print(snap.pid, flush=True)
            await asyncio.Event().wait()
        asyncio.run(main())
        """)
    app = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                           cwd=Path(__file__).resolve().parents[3])
    assert app.stdout is not None
    try:
        child_pid = int(app.stdout.readline())
        assert pid_alive(child_pid)
        app.kill()
        app.wait()
        deadline = time.monotonic() + 10
        while pid_alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the kernel for the orphan's death; no event to wait on
        assert not pid_alive(child_pid)
    finally:
        app.kill()
        app.stdout.close()


def test_the_engine_leaves_one_core_to_the_app_unless_told_otherwise(tiny_model):
    from backend.llama.supervisor import build_command, default_threads

    assert default_threads(8) == 7 and default_threads(2) == 1 and default_threads(1) == 1
    auto = build_command(Path("llama-server"), LoadSettings().to_spec(str(tiny_model)), 1234)
    assert auto[auto.index("--threads") + 1] == str(default_threads())
    chosen = build_command(Path("llama-server"), LoadSettings(threads=3).to_spec(str(tiny_model)), 1234)
    assert chosen[chosen.index("--threads") + 1] == "3"


def test_the_engine_keeps_four_context_checkpoints_a_slot_unless_told_otherwise(tiny_model):
    """Measured (bench/README.md, issue 35): 4 keep live and parked prefixes of sliding-
    window and hybrid models as llama.cpp's 32 do, in an eighth of the RAM and files."""
    from backend.llama.supervisor import build_command

    ours = build_command(Path("llama-server"), LoadSettings().to_spec(str(tiny_model)), 1234)
    assert ours[ours.index("--ctx-checkpoints") + 1] == "4"
    for given in (["-ctxcp", "16"], ["--swa-checkpoints=16"]):
        theirs = build_command(Path("llama-server"),
                               LoadSettings(extra_args=tuple(given)).to_spec(str(tiny_model)), 1234)
        assert "--ctx-checkpoints" not in theirs and theirs[-len(given):] == given


def llama_server_children() -> list[int]:
    """Live llama-server processes whose parent is this test process, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if comm == "llama-server" and fields[0] != "Z" and int(fields[1]) == os.getpid():
            found.append(int(entry.name))
    return found


async def test_overlapping_loads_and_unloads_leave_exactly_the_last_load_running(supervisor, tiny_model):
    specs = [LoadSettings(parallel=str(n), ctx_size=1024).to_spec(str(tiny_model)) for n in range(1, 7)]
    calls = []
    for i, spec in enumerate(specs):
        calls.append(supervisor.load(spec))
        if i % 2:
            calls.append(supervisor.unload())
    calls.append(supervisor.load(specs[2]))  # the last word
    async with asyncio.timeout(120):  # before serialization, a superseded load could wait forever
        results = await asyncio.gather(*calls, return_exceptions=True)
    try:
        last = results[-1]
        assert isinstance(last, Snapshot) and last.state is State.READY
        assert all(r is None or isinstance(r, (Snapshot, LoadSuperseded)) for r in results), results
        assert llama_server_children() == [last.pid]
        assert supervisor.snapshot.state is State.READY
        assert supervisor.snapshot.pid == last.pid
        assert supervisor.snapshot.requested == specs[2].settings
        assert (await props(last))["total_slots"] == 3
    finally:
        await supervisor.unload()
    assert llama_server_children() == []


async def test_engine_keeps_answering_after_log_lines_longer_than_64_kib(supervisor, tiny_model):
    """llama-server -v logs each /v1/responses request, converted, as one line; a reader
    that stopped at the first long line let the pipe fill, then the engine's log queue,
    and then every engine thread that logs (so every request) blocked."""
    spec = LoadSettings(parallel="1", ctx_size=1024, extra_args=("-v",)).to_spec(str(tiny_model))
    snapshot = await supervisor.load(spec)
    marker = "LONGLINE-"
    words = "x " * 50_000  # one ~100 KB log line per request
    body = {"model": "tiny", "input": marker + words, "max_output_tokens": 1}
    async with httpx.AsyncClient(base_url=snapshot.serving.base_url, timeout=15,
                                 headers=engine_headers(snapshot.serving.api_key)) as client:
        for _ in range(40):  # far more than the pipe (64 KiB) and the engine's log queue hold
            response = await client.post("/v1/responses", json=body)
            assert response.status_code == 400  # the prompt is longer than the context
        assert (await client.post("/tokenize", json={"content": "hi"})).status_code == 200
    long_lines = [line for line in supervisor.log_tail(1000) if marker in line]
    assert long_lines, "the long lines reach the tail"
    assert all(len(line) <= 4096 for line in long_lines)  # cut for display
    await supervisor.unload()
    logged = Path(snapshot.log_path).read_text()
    assert logged.count(marker + words.rstrip()) >= 40  # the file keeps every long line whole


async def test_an_engine_started_under_an_output_cap_obeys_it_for_requests_without_a_limit(
        llama_server_binary, tiny_model, tmp_path):
    cap = 7
    sup = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=60, stop_timeout=5,
                     output_cap=lambda: cap)
    try:
        snapshot = await sup.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
        serving = not_none(snapshot.serving)
        async with httpx.AsyncClient(base_url=serving.base_url, timeout=60,
                                     headers=engine_headers(serving.api_key)) as client:
            # -1 is "the engine's default": the cap, as for a request that sets none
            for limit in ({}, {"n_predict": -1}):
                answer = await client.post("/v1/completions", json={
                    "prompt": "hi", "ignore_eos": True, **limit})
                assert answer.json()["usage"]["completion_tokens"] == cap, limit
    finally:
        await sup.unload()


async def test_the_engines_own_port_refuses_requests_without_the_apps_key(supervisor, tiny_model,
                                                                         loose_umask):
    snapshot = await supervisor.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=snapshot.serving.base_url, timeout=30) as client:
        for path in ("/v1/chat/completions", "/completion"):
            refused = await client.post(path, json=request | {"prompt": "hi"})
            assert refused.status_code == 401
        assert (await client.get("/slots")).status_code == 401
        assert (await client.get("/props")).status_code == 401
        wrong = await client.post("/v1/chat/completions", json=request,
                                  headers={"authorization": "Bearer not-the-key"})
        assert wrong.status_code == 401
        answered = await client.post("/v1/chat/completions", json=request,
                                     headers=engine_headers(snapshot.serving.api_key))
        assert answered.status_code == 200
    assert snapshot.serving.api_key and len(snapshot.serving.api_key) >= 32
    assert snapshot.serving.api_key not in repr(snapshot)
    cmdline = Path(f"/proc/{snapshot.pid}/cmdline").read_bytes().decode()
    assert snapshot.serving.api_key not in cmdline  # the key is in a file, not in `ps`
    key_file = Path(cmdline.split("\0")[cmdline.split("\0").index("--api-key-file") + 1])
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.parent.stat().st_mode & 0o777 == 0o700
    await supervisor.unload()
    assert not key_file.exists()


async def test_engine_logs_are_bounded_in_size_and_number_per_model(llama_server_binary, tiny_model,
                                                                   tmp_path):
    max_bytes = 256 * 1024
    sup = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=60,
                     log_max_bytes=max_bytes, log_keep_starts=2)
    spec = LoadSettings(parallel="1", ctx_size=1024, extra_args=("-v",)).to_spec(str(tiny_model))
    other = tmp_path / "logs" / "llama-server-tinyer-20200101-000000-1.log"  # another model's
    other.parent.mkdir(parents=True)
    other.write_text("kept\n")
    body = {"model": "tiny", "input": "x " * 50_000, "max_output_tokens": 1}  # ~100 KB lines
    try:
        for start in range(3):
            snapshot = await sup.load(spec)
            assert snapshot.serving is not None and snapshot.log_path is not None
            async with httpx.AsyncClient(base_url=snapshot.serving.base_url, timeout=15,
                                         headers=engine_headers(snapshot.serving.api_key)) as client:
                for _ in range(8):  # ~800 KB of log per start: rotated at 256 KiB
                    assert (await client.post("/v1/responses", json=body)).status_code == 400
                marker = f"START-{start}-LAST"
                await client.post("/v1/responses", json=body | {"input": marker})
            await sup.unload()
            current = Path(snapshot.log_path)
            newest = current.with_name(current.name + ".1").read_text() + current.read_text()
            assert marker in newest  # the newest lines are kept
    finally:
        await sup.unload()
    logs = sorted(p for p in (tmp_path / "logs").iterdir() if p != other)
    assert len({p.name.removesuffix(".1") for p in logs}) == 2  # the two newest starts
    assert any(p.name.endswith(".log.1") for p in logs)  # it did rotate
    assert all(p.stat().st_size <= max_bytes for p in logs)
    assert sum(p.stat().st_size for p in logs) <= 2 * 2 * max_bytes
    assert other.read_text() == "kept\n"


async def test_the_engine_is_not_given_the_ports_key_or_hub_tokens(supervisor, tiny_model, monkeypatch):
    """Whoever reads the engine's environment (a crash dump, a /proc reader, a model's
    tool) must not find the port's key or the user's Hugging Face token there."""
    withheld = {"GGUF_STUDIO_API_KEY": "port-key-0123456789abcdef",
                "GGUF_STUDIO_API_KEY_FILE": "/home/someone/.config/gguf-studio/key",
                "HF_TOKEN": "hf_secret_token_of_the_user",
                "HUGGING_FACE_HUB_TOKEN": "hf_older_name_of_the_token"}
    for name, value in withheld.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GGUF_STUDIO_ENV_PASSED_ON", "no")
    snapshot = await supervisor.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
    raw = Path(f"/proc/{snapshot.pid}/environ").read_bytes().decode()
    environ = dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)
    await supervisor.unload()
    assert not set(withheld) & set(environ)
    assert not any(value in raw for value in withheld.values())
    assert "GGUF_STUDIO_ENV_PASSED_ON" not in environ  # none of the app's own settings
    assert environ["PATH"] == os.environ["PATH"]  # the rest is the engine's as before


def test_a_cpu_that_claims_amx_loads_without_repacked_weights(tiny_model):
    """On such a CPU the pinned llama.cpp dies loading a Q4_1 model (SmolLM2) in its AMX
    layout; test_real_models proves the load where this machine claims AMX."""
    from backend.llama.supervisor import build_command

    spec = LoadSettings().to_spec(str(tiny_model))
    assert "--no-repack" in build_command(Path("llama-server"), spec, 1234, amx=True)
    assert "--no-repack" not in build_command(Path("llama-server"), spec, 1234, amx=False)
    given = LoadSettings(extra_args=("--no-repack",)).to_spec(str(tiny_model))
    assert build_command(Path("llama-server"), given, 1234, amx=True).count("--no-repack") == 1


def test_amx_is_read_from_the_cpus_flags():
    from backend.llama.accelerators import cpu_claims_amx

    assert cpu_claims_amx("processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n")
    assert not cpu_claims_amx("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert not cpu_claims_amx("")
