"""`gguf-studio connect` where it does not end in a key: multicast finds nothing (it says
so and asks for the address), and the owner refuses (nothing is minted or written; the
address was shown as a QR code first, with --qr)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from backend.app.discovery import ENV_INTERFACES
from backend.key_store import KeyStore
from tests.backend.gateway_harness import until

ROOT = Path(__file__).resolve().parents[3]
OWNER_KEY = "owner-key-for-the-connect-tests-012345"


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
    service = await running_service(api_key=OWNER_KEY)
    proc = await connect(teammate(tmp_path), f"http://127.0.0.1:{service.gateway_port}",
                         "--name", "bob", "--qr")
    await until(lambda: bool(service.enrolments.pending()), 30)
    service.refuse_enrolment("bob")
    out, err = await asyncio.wait_for(proc.communicate(), 60)

    assert proc.returncode == 1, out.decode() + err.decode()
    assert "Using the address given" in out.decode()
    assert "█" in out.decode()  # --qr: the address as a QR code, before the request
    assert "refused" in err.decode(), err.decode()
    assert KeyStore().records() == []
    assert not (tmp_path / ".config" / "gguf-studio").exists()
    assert not (tmp_path / ".codex").exists()
