"""`gguf-studio rpc-worker` and `serve --rpc` as a user runs them: real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from backend.llama.rpc_worker import protocol_of_sources
from backend.llama.supervisor import pick_free_port
from tests.backend.app.test_cli import ROOT, cli, user_dirs  # noqa: F401 - a fixture
from tests.not_none import not_none


def test_a_worker_warns_listens_on_loopback_and_serve_spreads_the_model_over_it(
        tiny_model, llama_server_binary, source_tree, user_dirs):  # noqa: F811
    port = pick_free_port()
    worker = start("rpc-worker", "--port", str(port), "--threads", "1", env=user_dirs)
    serve = None
    try:
        ready = read_until(worker, "RPC worker ready")
        assert ready == (f"RPC worker ready on 127.0.0.1:{port} (RPC protocol {protocol_of_sources(source_tree)}). On the "
                         f"engine's machine: gguf-studio serve --model MODEL --rpc 127.0.0.1:{port}")
        serve = start("serve", "--model", str(tiny_model), "--port", "0", "--ctx-size", "1024",
                      "--parallel", "1", "--n-gpu-layers", "all", "--rpc", f"127.0.0.1:{port}",
                      "--llama-server", str(llama_server_binary), env=user_dirs)
        lines = read_lines_until(serve, "[ready]")
        assert f"runs on rpc: 3/3 layers on RPC0 (127.0.0.1:{port})" in lines[-1]
        url = next(l.strip() for l in lines if l.strip().startswith("http://"))
        answer = httpx.post(f"{url}/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        serve.send_signal(signal.SIGINT)
        assert serve.wait(30) == 0
        worker_server = child_of(worker.pid, "ggml-rpc-server")
        worker.send_signal(signal.SIGINT)
        assert worker.wait(30) == 0
        assert not Path(f"/proc/{worker_server}").exists()  # no RPC port left open
        stderr = not_none(worker.stderr).read()
        assert stderr.startswith("WARNING: llama.cpp's RPC is insecure. This worker accepts "
                                 "this machine only (loopback)")
        assert "Use it on a trusted wired network only" in stderr
    finally:
        for proc in (serve, worker):
            if proc is not None:
                proc.kill()
                proc.wait()
                not_none(proc.stdout).close()
                not_none(proc.stderr).close()


def test_a_worker_refuses_a_network_address_unless_the_risk_is_accepted(user_dirs):  # noqa: F811
    out = cli("rpc-worker", "--host", "0.0.0.0", env=user_dirs)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1
    assert "Refusing to listen on 0.0.0.0" in out.stderr
    assert "--i-understand-rpc-is-insecure" in out.stderr

    port = pick_free_port()
    worker = start("rpc-worker", "--host", "0.0.0.0", "--port", str(port), "--threads", "1",
                   "--i-understand-rpc-is-insecure", env=user_dirs)
    try:
        assert read_until(worker, "RPC worker ready").startswith(
            f"RPC worker ready on 0.0.0.0:{port}")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        assert f"accepts every machine that can reach 0.0.0.0:{port}" in not_none(worker.stderr).read()
    finally:
        worker.kill()
        worker.wait()
        not_none(worker.stdout).close()
        not_none(worker.stderr).close()


def test_serve_names_an_unusable_worker_before_starting_anything(tiny_model, user_dirs):  # noqa: F811
    out = cli("serve", "--model", str(tiny_model), "--port", "0", "--rpc", "[::1]:50052",
              env=user_dirs)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "IPv4 only" in out.stderr
    out = cli("serve", "--model", str(tiny_model), "--port", "0", "--rpc", "127.0.0.1:50052",
              "--n-gpu-layers", "none", env=user_dirs)
    assert out.returncode == 1 and "keeps every layer on this machine" in out.stderr
    out = cli("serve", "--upstream", "http://127.0.0.1:9", "--rpc", "127.0.0.1:50052",
              env=user_dirs)
    assert out.returncode == 1 and "an --upstream engine has its own" in out.stderr


def start(*args: str, env: dict) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "backend.app.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen[str], start_of_line: str) -> str:
    return read_lines_until(proc, start_of_line)[-1]


def read_lines_until(proc: subprocess.Popen[str], start_of_line: str) -> list[str]:
    lines: list[str] = []
    for line in not_none(proc.stdout):
        lines.append(line.rstrip())
        if line.startswith(start_of_line) or line.startswith("[failed]"):
            return lines
    raise AssertionError(f"ended without {start_of_line!r}: {lines} {not_none(proc.stderr).read()}")


def child_of(parent: int, name: str) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and f"({name[:15]})" in stat:
                return int(entry.name)
    raise AssertionError(f"no {name} child of {parent}")

