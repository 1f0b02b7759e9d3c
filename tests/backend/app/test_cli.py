"""`gguf-studio` as a user runs it: a real process, real output, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.model_factory import write_not_gguf
from tests.not_none import not_none

ROOT = Path(__file__).resolve().parents[3]


def cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.app.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, env=env, timeout=120, **kwargs)


@pytest.fixture
def user_dirs(tmp_path: Path) -> dict:
    """A user with no saved settings, logs kept in tmp."""
    return dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"),
                XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"))


def test_inspect_prints_the_models_card(tiny_model):
    out = cli("inspect", str(tiny_model))
    assert out.returncode == 0
    assert "llama" in out.stdout


def test_inspect_json_is_machine_readable(tiny_model):
    info = json.loads(cli("inspect", str(tiny_model), "--json").stdout)
    assert info["architecture"] == "llama"
    assert info["has_chat_template"] is True


def test_inspect_of_a_broken_file_is_one_clear_line(tmp_path):
    out = cli("inspect", str(write_not_gguf(tmp_path / "notes.gguf")))
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1
    assert "notes.gguf" in out.stderr and "Traceback" not in out.stderr


def test_serve_refuses_a_lan_bind_without_a_key(tiny_model, user_dirs):
    env = {k: v for k, v in user_dirs.items() if k != "GGUF_STUDIO_API_KEY"}
    out = cli("serve", "--model", str(tiny_model), "--host", "0.0.0.0", env=env)
    assert out.returncode == 1
    assert "without an API key" in out.stderr and "--allow-no-key" in out.stderr


def test_serve_refuses_a_short_key_with_one_clear_line(tiny_model, user_dirs):
    env = {k: v for k, v in user_dirs.items() if not k.startswith("GGUF_STUDIO_API_KEY")}
    out = cli("serve", "--model", str(tiny_model), "--host", "0.0.0.0", "--api-key", "letmein",
              env=env)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "API key is too short (7 characters)" in out.stderr and "at least 16" in out.stderr


def test_serve_runs_until_interrupted_and_leaves_no_engine_behind(tiny_model, llama_server_binary,
                                                                  user_dirs):
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "serve", "--model", str(tiny_model), "--port", "0",
         "--parallel", "2", "--ctx-size", "2048", "--llama-server", str(llama_server_binary)],
        cwd=ROOT, env=user_dirs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("[ready]") or line.startswith("[failed]"):
                break
        # An engine built with RPC counts the layers it keeps on the CPU; one from before
        # RPC does not.
        assert re.match(
            r"\[ready\] tiny: effective parallel slots 2, context 1024 per slot; "
            r"KV cache: up to 2 requests at once; each slot has its own 1,024 tokens; "
            r"runs on the CPU( \(all 3 layers\))?; memory: ", lines[-1]), lines[-1]
        url = next(l.strip() for l in lines if l.strip().startswith("http://"))
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url)
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
        assert health["effective_parallel_slots"] == 2
        engine_pid = _engine_pid(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert not Path(f"/proc/{engine_pid}").exists()
    finally:
        proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def _engine_pid(parent: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == parent and "llama-server" in stat:
                return int(entry.name)
    raise AssertionError("no llama-server child")


def test_serve_with_a_key_file_keeps_the_key_out_of_the_process_list_and_allows_origins(tmp_path, user_dirs):
    key = "gs-kept-out-of-ps-" + os.urandom(8).hex()
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    env = {k: v for k, v in user_dirs.items() if not k.startswith("GGUF_STUDIO_API_KEY")}
    # Attached to an upstream that never answers: the port opens all the same.
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "serve", "--upstream", "http://127.0.0.1:9",
         "--port", "0", "--api-key-file", str(key_file),
         "--allow-origin", "https://chat.example.com"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        url = ""
        for line in proc.stdout:
            if line.strip().startswith("http://"):
                url = line.strip().removesuffix("/v1")
                break
        assert url, proc.stderr.read()
        listing = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(proc.pid)],
                                 capture_output=True, text=True, check=True).stdout
        assert "--api-key-file" in listing and key not in listing
        assert key.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert httpx.get(url + "/v1/models").status_code == 401
        answer = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}",
                                                        "Origin": "https://chat.example.com"})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://chat.example.com"
        foreign = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}",
                                                         "Origin": "https://evil.example"})
        assert foreign.status_code == 403
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert not (Path(user_dirs["XDG_CONFIG_HOME"]) / "gguf-studio" / "settings.json").exists()
    finally:
        proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_serve_reads_the_upstream_key_file_and_says_when_it_cannot(tmp_path, user_dirs):
    out = cli("serve", "--upstream", "http://127.0.0.1:9", "--port", "0",
              "--upstream-api-key-file", str(tmp_path / "missing.key"), env=user_dirs)
    assert out.returncode == 1
    assert "missing.key cannot be read" in out.stderr and "Traceback" not in out.stderr


def test_serve_refuses_an_upstream_kv_layout_it_does_not_know(user_dirs):
    out = cli("serve", "--upstream", "http://127.0.0.1:9", "--upstream-kv", "shared", env=user_dirs)
    assert out.returncode == 2
    assert "--upstream-kv: invalid choice: 'shared'" in out.stderr
    assert "split" in out.stderr and "unified" in out.stderr


def test_an_upstreams_password_is_never_printed_nor_logged(user_dirs):
    """`serve --upstream http://user:password@host` (an engine that does not answer yet):
    the status lines and the verbose log name it as http://***@host."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "-v", "serve", "--port", "0",
         "--upstream", "http://team:hunter2-secret@127.0.0.1:9/v1"],
        cwd=ROOT, env=user_dirs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = []
        for line in not_none(proc.stdout):
            said.append(line)
            if "does not answer" in line:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    printed = "".join(said) + out
    assert "[starting] http://***@127.0.0.1:9: The upstream does not answer." in printed
    assert "http://***@127.0.0.1:9" in err  # the verbose log names it too
    assert "hunter2" not in printed + err


def test_the_upstream_key_flag_warns_that_others_see_it_in_the_process_list():
    import argparse
    from backend.app.cli import _parser
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    helps = {flag: action.help for action in serve._actions for flag in action.option_strings}
    for flag in ("--api-key", "--upstream-api-key"):
        assert f"visible to other local users in the process list, see {flag}-file" in helps[flag]


def test_inspect_shows_a_models_own_name_escaped_so_it_cannot_drive_the_terminal(tmp_path, vocab_path):
    from tests.model_factory import write_tiny_model
    hostile = write_tiny_model(tmp_path / "hostile.gguf", vocab_path,
                               name="Nice\x1b]0;pwned\x07\x1b[2J\u202eflugg.exe")
    out = cli("inspect", str(hostile))
    assert out.returncode == 0
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout and "\u202e" not in out.stdout
    assert "Name: Nice\\x1b]0;pwned\\x07\\x1b[2J\\u202eflugg.exe" in out.stdout


def serve_until_open(env: dict, *argv: str) -> tuple[subprocess.Popen, str]:
    """`serve` with an upstream that does not answer (no model needed): the process and
    the base URL it prints once its port is open."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "serve", "--port", "0",
         "--upstream", "http://127.0.0.1:9", *argv],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = next((line.strip() for line in not_none(proc.stdout) if line.strip().startswith("http://")), "")
    if not url:
        proc.kill()
        raise AssertionError(not_none(proc.stderr).read())
    return proc, url.replace("0.0.0.0", "127.0.0.1")


def stop_serving(proc: subprocess.Popen) -> str:
    """Stop `serve` as Ctrl+C does; returns what it wrote to stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        return err
    finally:
        proc.kill()


def test_named_keys_guard_a_lan_port_alone_and_stay_required_when_the_keys_file_goes(user_dirs):
    """With no owner key: a named key is enough to serve on the network (no --allow-no-key,
    no warning that nothing guards it), and once named keys were used, deleting keys.json
    does not open the port to everyone."""
    secret = cli("keys", "add", "alice", env=user_dirs).stdout.strip()
    proc, url = serve_until_open(user_dirs, "--host", "0.0.0.0")
    try:
        assert httpx.get(f"{url}/models").status_code == 401
        assert httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
    finally:
        err = stop_serving(proc)
    assert "WITHOUT AN API KEY" not in err

    keys_file = Path(user_dirs["XDG_CONFIG_HOME"]) / "gguf-studio" / "keys.json"
    keys_file.unlink()
    proc, url = serve_until_open(user_dirs)
    try:
        assert httpx.get(f"{url}/models").status_code == 401  # still guarded
    finally:
        err = stop_serving(proc)
    assert "holds no keys, but named keys were used" in err
    settings = json.loads((keys_file.parent / "settings.json").read_text())
    assert settings == {"keys_required": True}  # the marker alone: nothing else was saved


def test_serve_takes_enrolment_requests_for_the_minutes_given_and_says_until_when(user_dirs):
    """`serve --accept-enrolments MINUTES` opens enrolment on a port that is not announced,
    says until when, and /health tells the owner; without it the port takes none."""
    key = "owner-key-for-the-cli-enrolment-0123"
    owner = {"Authorization": f"Bearer {key}"}
    started = time.time()
    proc, url = serve_until_open(user_dirs, "--api-key", key, "--accept-enrolments", "5")
    try:
        said = next(not_none(proc.stdout)).strip()
        root = url.removesuffix("/v1")
        asked = httpx.post(f"{root}/v1/enrolments", json={"name": "bob"}, timeout=30)
        window = httpx.get(f"{root}/health", headers=owner, timeout=30).json()["enrolment"]
    finally:
        stop_serving(proc)
    assert asked.status_code == 202, asked.text
    assert window["open"] and window["reason"] == "accepting"
    closes = datetime.fromisoformat(window["accepting_until"]).timestamp()
    assert started + 300 - 1 <= closes <= time.time() + 300
    assert said.startswith("Teammates may ask for a key until ") and \
        datetime.fromtimestamp(closes).strftime("%H:%M") in said, said

    proc, url = serve_until_open(user_dirs, "--api-key", key)  # neither announced nor accepting
    try:
        said = next(not_none(proc.stdout)).strip()
        refused = httpx.post(f"{url.removesuffix('/v1')}/v1/enrolments", json={"name": "bob"},
                             timeout=30)
    finally:
        stop_serving(proc)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "enrolment_closed"
    assert "--accept-enrolments" in refused.json()["error"]["message"]
    assert said.startswith("Teammates cannot ask for a key now"), said


def test_an_accept_window_longer_than_a_day_is_refused_with_one_clear_line(user_dirs):
    out = cli("serve", "--upstream", "http://127.0.0.1:9", "--accept-enrolments", "2000",
              env=user_dirs)
    assert out.returncode == 1
    assert out.stderr.strip() == ("gguf-studio: Accept enrolment requests for 0 to 1440 minutes "
                                  "(a day), not 2000; announce the port to keep it open.")
