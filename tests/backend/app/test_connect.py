"""`gguf-studio connect` as a teammate runs it: multicast finds nothing (it says so and
asks for the address), the owner refuses (nothing is minted or written; the address was
shown as a QR code first, with --qr), and two ports connected to one after the other
each keep their own key."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from backend.app.discovery import ENV_INTERFACES
from backend.key_store import KeyStore
from tests.backend.gateway_harness import until

ROOT = Path(__file__).resolve().parents[3]
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
