"""`gguf-studio connect` as a teammate runs it: multicast finds nothing (it says so and
asks for the address), the owner refuses (nothing is minted or written; the address was
shown as a QR code first, with --qr), two ports connected to one after the other each
keep their own key; a name a device took as well as the owner's port is never chosen
silently, and through a relay the teammate's code is not the owner's."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backend.app.sharing.discovery import ENV_INTERFACES
from backend.keys.key_store import KeyStore
from tests.backend.gateway_harness import until
from tests.backend.lan_harness import Impostor, Relay

ROOT = Path(__file__).resolve().parents[4]
OWNER_KEY = "owner-key-for-the-connect-tests-012345"


def accepting() -> dict[str, object]:
    """The settings of an owner who accepts enrolment requests for the next ten minutes."""
    return {"api_key": OWNER_KEY, "accept_enrolments_until": time.time() + 600}


def teammate(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), CODEX_HOME=str(home / ".codex"))
    env[ENV_INTERFACES] = "127.0.0.1"
    return env


async def connect(env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "connect", *args, cwd=ROOT, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)


async def test_when_multicast_finds_nothing_connect_says_so_and_asks_for_the_address(tmp_path):
    proc = await connect(teammate(tmp_path), "--browse-seconds", "1", "--name", "bob")
    out, err = await asyncio.wait_for(proc.communicate(), 60)

    assert proc.returncode == 1
    assert "multicast found nothing" in err.decode(), err.decode()
    assert "gguf-studio connect http://HOST:PORT" in err.decode()


async def test_a_refused_teammate_gets_no_key_and_nothing_is_written(running_service, tmp_path):
    service = await running_service(**accepting())
    proc = await connect(teammate(tmp_path), f"http://127.0.0.1:{service.gateway_port}",
                         "--name", "bob", "--qr")
    await until(lambda: bool(service.enrolments.pending()), 30)
    (request,) = service.enrolments.waiting()
    service.refuse_enrolment(request)
    out, err = await asyncio.wait_for(proc.communicate(), 60)

    assert proc.returncode == 1, out.decode() + err.decode()
    assert "Using the address given" in out.decode()
    assert "█" in out.decode()  # --qr: the address as a QR code, before the request
    assert "refused" in err.decode(), err.decode()
    assert KeyStore().records() == []
    assert not (tmp_path / ".config" / "gguf-studio").exists()
    assert not (tmp_path / ".codex").exists()


async def enrol(service, env: dict[str, str], name: str) -> str:
    """`connect` to `service` by its address, approved by the owner: what it printed."""
    proc = await connect(env, f"http://127.0.0.1:{service.gateway_port}", "--name", name)
    await until(lambda: any(e.name == name for e in service.enrolments.pending()), 30)
    service.approve_enrolment(next(r for r in service.enrolments.waiting() if r.name == name))
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode() + err.decode()
    return out.decode()


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
async def test_a_second_port_gets_a_profile_of_its_own_and_a_replaced_key_is_kept(
        running_service, tmp_path, loose_umask):
    first = await running_service(**accepting())
    second = await running_service(**accepting())
    env = teammate(tmp_path)
    connections = tmp_path / ".config" / "gguf-studio" / "connections"

    said = await enrol(first, env, "bob")
    await enrol(second, env, "bob2")

    # Without --profile each port is its own profile: the first key is still there.
    one, two = (connections / f"127-0-0-1-{s.gateway_port}.key" for s in (first, second))
    first_secret, second_secret = one.read_text().strip(), two.read_text().strip()
    assert first_secret.startswith("gs-") and second_secret.startswith("gs-")
    assert first_secret != second_secret
    assert f"codex --profile 127-0-0-1-{first.gateway_port}" in said
    # The same port again: the key it replaces is backed up, as private as the key.
    again = await enrol(first, env, "bob3")
    (backup,) = connections.glob(f"{one.name}.bak-*")
    assert backup.read_text().strip() == first_secret
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    assert f"backup {backup}" in again
    assert one.read_text().strip() not in (first_secret, second_secret)


@pytest.fixture
async def impostor() -> AsyncIterator[Impostor]:
    device = Impostor()
    yield device
    await device.leave()


async def test_a_name_two_ports_answer_to_is_never_chosen_silently(running_service, impostor,
                                                                     tmp_path, monkeypatch):
    # A device announced "office" first; the owner's port is then announced as "office-2".
    monkeypatch.setenv(ENV_INTERFACES, "127.0.0.1")
    trap = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    trap_port = trap.sockets[0].getsockname()[1]
    await impostor.announce("office", trap_port)
    service = await running_service(host="0.0.0.0", api_key=OWNER_KEY, advertise=True,
                                    advertise_name="office")
    await service.announced()
    assert service.advertiser.name == "office-2"

    proc = await connect(teammate(tmp_path), "office", "--name", "bob")
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    trap.close()

    said = err.decode()
    assert proc.returncode == 1, out.decode() + said
    assert "Several ports answer to 'office'" in said and "posing as the owner's port" in said
    assert f"office at http://127.0.0.1:{trap_port}" in said
    assert f"office-2 at http://" in said and f":{service.gateway_port}" in said
    assert "gguf-studio connect http://HOST:PORT" in said
    assert service.enrolments.pending() == []  # nothing was asked of anyone


@pytest.mark.skipif(os.name == "nt", reason="a pseudo-terminal")
async def test_at_a_terminal_the_teammate_is_asked_which_port_and_picks_the_owners(
        running_service, impostor, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_INTERFACES, "127.0.0.1")
    await impostor.announce("office", 9)
    service = await running_service(host="0.0.0.0", api_key=OWNER_KEY, advertise=True,
                                    advertise_name="office")
    await service.announced()
    terminal, tty = os.openpty()  # the teammate types at a terminal
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "connect", "office", "--name", "bob", cwd=ROOT,
        env=teammate(tmp_path), stdin=tty, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    os.close(tty)
    try:
        assert proc.stdout is not None
        said = await read_until(proc.stdout, "Which one (1-2)? ", lines=False)
        assert "one may be a device posing as the owner's port" in said
        # The last list is the one asked about: "  N. office-2  http://...".
        owners = next(line for line in said.splitlines()[::-1] if "office-2  http" in line)
        os.write(terminal, owners.split(".", 1)[0].strip().encode() + b"\n")
        said += await read_until(proc.stdout, "Waiting for the owner")
    finally:
        proc.kill()
        await proc.wait()
        os.close(terminal)

    (request,) = service.enrolments.pending()
    assert request.name == "bob"
    assert f":{service.gateway_port}." in said.split("Connecting to office-2 at ", 1)[1]
    assert f"Code: {request.code}\n" in said


async def test_connect_shows_the_port_it_uses_and_the_same_code_as_the_owner(running_service,
                                                                            tmp_path):
    service = await running_service(**accepting())
    root = f"http://127.0.0.1:{service.gateway_port}"
    proc = await connect(teammate(tmp_path), root, "--name", "bob")
    try:
        assert proc.stdout is not None
        said = await read_until(proc.stdout, "Waiting for the owner")
    finally:
        proc.kill()
        await proc.wait()

    (request,) = service.enrolments.pending()
    assert f"Connecting to 127.0.0.1:{service.gateway_port} at {root}." in said
    assert f"Code: {request.code}\n" in said
    assert "The port sees you as 127.0.0.1, as you are." in said
    assert "Warning" not in said


@pytest.mark.parametrize("relay_source", ["127.0.0.3", "127.0.0.1"])
async def test_through_a_relay_the_teammate_and_the_owner_see_different_codes(
        running_service, tmp_path, relay_source):
    """A device passes the teammate's connection on to the port: from an address of its
    own, or from the teammate's own address (the port then sees the teammate's address,
    but the teammate reached another)."""
    service = await running_service(**accepting(), host="0.0.0.0")
    relay = Relay(("127.0.0.1", service.gateway_port), listen="127.0.0.2", source=relay_source)
    await relay.start()
    relay_url = relay.url
    proc = await connect(teammate(tmp_path), relay_url, "--name", "bob")
    try:
        assert proc.stdout is not None
        said = await read_until(proc.stdout, "Waiting for the owner")
    finally:
        proc.kill()
        await proc.wait()
        await relay.close()

    (request,) = service.enrolments.pending()
    assert request.address == relay_source and relay.connections >= 1
    shown = said.split("Code: ", 1)[1].split()[0]
    assert shown != request.code  # read out to the owner, it matches nothing on their screen
    assert request.code not in said  # the port's own code, passed on by the relay: never shown
    assert f"Warning: the port sees you as {relay_source}, reached at 127.0.0.1:" in said
    assert f"talking to 127.0.0.2:{relay_url.rsplit(':', 1)[1]}" in said


async def read_until(stream: asyncio.StreamReader, wanted: str, timeout: float = 60, *,
                     lines: bool = True) -> str:
    """What `stream` said up to and with the first line holding `wanted` (with `lines`
    off, up to `wanted` itself: a prompt ends no line)."""
    said = ""
    while wanted not in said:
        chunk = await asyncio.wait_for(stream.readline() if lines else stream.read(4096),
                                       timeout)
        if not chunk:
            raise AssertionError(f"output ended before {wanted!r}:\n{said}")
        said += chunk.decode(errors="replace")
    return said


class StrangePort:
    """A server posing as a port that answers with escape codes wherever it may: no real
    port does, a hostile one would (to clear the screen, retitle the terminal, hide what
    it says).  It approves at once."""

    ESC = "\x1b[2J\x1b]0;owned\x07"

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        esc = self.ESC

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.startswith("/health"):
                    return self.answer(200, {"status": "ok"})
                self.answer(200, {"status": "approved", "name": "bob" + esc,
                                  "api_key": "gs-" + "k" * 43,
                                  "port": {"model_id": "m" + esc, "context_length": 4096,
                                           "max_output_tokens": 256,
                                           "default_output_tokens": 128, "others": [],
                                           "small_model": "", "default_alias": ""}})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.answer(202, {"id": "x", "name": "bob" + esc, "code": esc,
                                  "address": esc + "10.0.0.66", "port_address": [esc, 1]})

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_what_a_port_says_is_printed_without_its_escape_codes(tmp_path):
    strange = StrangePort()
    try:
        proc = await connect(teammate(tmp_path), strange.url, "--name", "bob")
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        strange.close()

    said = out.decode() + err.decode()
    assert proc.returncode == 0, said
    assert "\x1b" not in said and "\x07" not in said
    assert "Warning: the port sees you as \\x1b[2J" in said  # shown, escaped
    assert "key 'bob\\x1b[2J\\x1b]0;owned\\x07'" in said
    assert "m\\x1b[2J" in said  # the model in the command to start OpenCode
