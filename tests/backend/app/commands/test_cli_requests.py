"""`gguf-studio requests` as a user runs it: a real process against a real port, with the
saved port and owner's key."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from backend.app.service import StudioService
from backend.llama.load import LoadSettings
from backend.settings import Settings
from tests.backend.service_harness import ServiceFactory

ROOT = Path(__file__).resolve().parents[4]
OWNER_KEY = "owner-key-0123456789abcdef"


@pytest.fixture
async def service(running_service: ServiceFactory, tiny_model: Path) -> StudioService:
    service = await running_service(api_key=OWNER_KEY)
    await service.load(LoadSettings(parallel="1", ctx_size=4096).to_spec(str(tiny_model)))
    return service


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A user with no key in the environment; their settings under tmp_path."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    return dict(base, XDG_CONFIG_HOME=str(tmp_path / "config"),
                XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"))


async def requests_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "backend.app.cli", "requests", *args], cwd=ROOT,
        text=True, capture_output=True, env=env, timeout=60)


async def test_requests_prints_the_ring_with_the_saved_port_and_owner_key(service, env, tmp_path):
    port = service.gateway_port
    assert port is not None
    Settings(port=port, api_key=OWNER_KEY).save(tmp_path / "config" / "gguf-studio" / "settings.json")
    _, secret = service.keys.add("alice")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        for key, tokens in ((OWNER_KEY, 3), (secret, 5)):
            answer = await client.post(
                "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny", "max_tokens": tokens, "ignore_eos": True,
                      "messages": [{"role": "user", "content": "Hi"}]})
            assert answer.status_code == 200, answer.text

    listed = await requests_cli(env, "--json")
    assert listed.returncode == 0, listed.stderr
    records = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["key"], r["model"], r["status"], r["output_tokens"]) for r in records] == \
        [("owner", "tiny", 200, 3), ("alice", "tiny", 200, 5)]
    assert all(r["engine"] == "this machine" and r["slot"] == 0 for r in records)

    table = await requests_cli(env, "--port", str(port))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert len(lines) == 2 and "alice" in lines[1] and "tiny" in lines[1] and "200" in lines[1]
    assert "out 5" in lines[1]


async def test_requests_with_a_wrong_key_or_no_port_says_so(service, env, tmp_path):
    port = service.gateway_port
    Settings(port=port, api_key="not-the-owners-key-0123456789").save(
        tmp_path / "config" / "gguf-studio" / "settings.json")
    refused = await requests_cli(env)
    assert refused.returncode == 1 and "refused the key" in refused.stderr
    nowhere = await requests_cli(env, "--port", "9")
    assert nowhere.returncode == 1 and "No GGUF Studio port answers" in nowhere.stderr


async def test_requests_follow_prints_each_request_as_it_ends(service, env):
    port = service.gateway_port
    env = dict(env, GGUF_STUDIO_API_KEY=OWNER_KEY)
    follower = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "requests", "--follow", "--json",
        "--port", str(port), cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            for tokens in (2, 4):
                answer = await client.post(
                    "/v1/chat/completions", headers={"Authorization": f"Bearer {OWNER_KEY}"},
                    json={"model": "tiny", "max_tokens": tokens, "ignore_eos": True,
                          "messages": [{"role": "user", "content": "Hi"}]})
                assert answer.status_code == 200, answer.text
                assert follower.stdout is not None
                line = await asyncio.wait_for(follower.stdout.readline(), 30)
                assert json.loads(line)["output_tokens"] == tokens
    finally:
        follower.terminate()
        await follower.wait()


class StrangePort:
    """A server that is not this machine's port: whatever listens at an address the user
    typed.  It keeps the keys it is sent and answers records with escape codes (no real
    port names a key or model so; a hostile one may)."""

    ESCAPES = "\x1b]0;pwned\x07\x1b[2J"

    def __init__(self) -> None:
        import http.server
        import threading

        self.keys: list[str] = []
        strange = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                strange.keys.append(self.headers.get("Authorization", ""))
                record = {"id": 1, "time": 0.0, "route": "/v1/chat/completions",
                          "key": "eve" + strange.ESCAPES, "model": "m\x1b[31mred", "status": 200}
                body = json.dumps({"data": [record], "last_id": 1}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def strange_port():
    port = StrangePort()
    yield port
    port.close()


async def test_requests_at_another_address_never_sends_the_saved_owner_key(strange_port, env,
                                                                           tmp_path):
    Settings(port=8899, api_key=OWNER_KEY).save(tmp_path / "config" / "gguf-studio" / "settings.json")

    asked = await requests_cli(env, "--url", strange_port.url)

    assert asked.returncode == 1
    assert "not this machine's port" in asked.stderr and "--api-key-file" in asked.stderr
    assert strange_port.keys == []  # nothing was sent at all
    key_file = tmp_path / "theirs.key"
    key_file.write_text("their-owner-key-0123456789\n")
    key_file.chmod(0o600)
    given = await requests_cli(env, "--url", strange_port.url, "--api-key-file", str(key_file))
    assert given.returncode == 0, given.stderr
    assert strange_port.keys == ["Bearer their-owner-key-0123456789"]
    assert OWNER_KEY not in "".join(strange_port.keys)


async def test_what_a_port_answers_is_printed_without_its_escape_codes(strange_port, env, tmp_path):
    key_file = tmp_path / "theirs.key"
    key_file.write_text("their-owner-key-0123456789\n")
    key_file.chmod(0o600)

    table = await requests_cli(env, "--url", strange_port.url, "--api-key-file", str(key_file))

    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout and "\x07" not in table.stdout
    assert "eve\\x1b]0;pwned\\x07\\x1b[2J" in table.stdout  # shown, escaped
    assert "m\\x1b[31mred" in table.stdout
