"""`gguf-studio connect` end to end: a teammate with nothing gets a key and a working Codex.

Two homes on this machine: the owner's (`serve` sharing the suite's tiny 32k-context model
(Codex's own prompt is 5k tokens, which SmolLM2 on one CPU thread reads too slowly for the
minute) on the LAN with a key,
announced over mDNS on the loopback interface) and the teammate's (HOME and the XDG dirs
of its own, a Codex config.toml and an OpenCode config already there).  The teammate
runs `connect`, the owner approves with `keys approve` after checking the code, and
Codex CLI, with nothing but what `connect` wrote, answers with the model's text.  The
time from the teammate's first command to Codex's answer is printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import cast

import pytest

from backend.app.service import StudioService
from tests.clients.conftest import (CODEX_OFFLINE_ROOT, CODEX_OFFLINE_TABLES, CONTEXT, MODEL_ID,
                                    OUTPUT_CAP, REPO, Clients, OpenCode, Process, clean_env)

pytestmark = pytest.mark.timeout(600)

OWNER_KEY = "owner-key-of-the-office-port-0123456789"
PORT_NAME = "office"
TARGET_SECONDS = 60.0


def home(root: Path) -> dict[str, str]:
    """A user's own HOME and XDG dirs, nothing of this session's."""
    env = clean_env(root)
    env.pop("GGUF_STUDIO_TEST_API_KEY", None)
    env["PYTHONPATH"] = str(REPO)
    env["GGUF_STUDIO_MDNS_INTERFACES"] = "127.0.0.1"  # mDNS stays on this machine
    return env


async def gguf_studio(env: dict[str, str], *args: str) -> Process:
    return await Process.start([sys.executable, "-m", "backend.app.cli", *args], env=env,
                               cwd=REPO, timeout=300)


async def read_until(stream: asyncio.StreamReader, wanted: str | tuple[str, ...],
                     seen: list[str], timeout: float = 120, *, eof_ok: bool = False) -> str:
    """The first line holding `wanted` (or one of them); "" at the end when `eof_ok`."""
    deadline = time.monotonic() + timeout
    words = (wanted,) if isinstance(wanted, str) else wanted
    while True:
        try:
            line = await asyncio.wait_for(stream.readline(), max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise AssertionError(f"no {wanted!r} within {timeout:g}s:\n" + "".join(seen)) from None
        if not line:
            if eof_ok:
                return ""
            raise AssertionError(f"output ended before {wanted!r}:\n" + "".join(seen))
        text = line.decode(errors="replace")
        seen.append(text)
        if any(word in text for word in words):
            return text


async def start_connect(env: dict[str, str], target: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "connect", target, "--name", "bob",
        env=env, cwd=REPO, stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


async def test_a_teammate_connects_is_approved_and_codex_answers_within_a_minute(
        clients: Clients, opencode: OpenCode, long_context_model, llama_server_binary, tmp_path,
        loose_umask):
    owner = home(tmp_path / "owner")
    owner["GGUF_STUDIO_API_KEY"] = OWNER_KEY
    mate = home(tmp_path / "mate")
    codex_home = Path(mate["HOME"]) / ".codex"
    codex_home.mkdir()
    # What the teammate had before: Codex's config (with the suite's offline switches)
    # and an OpenCode provider of their own.
    config_toml = "\n".join([*CODEX_OFFLINE_ROOT, *CODEX_OFFLINE_TABLES]) + "\n"
    (codex_home / "config.toml").write_text(config_toml)
    opencode_json = Path(mate["XDG_CONFIG_HOME"]) / "opencode" / "opencode.json"
    opencode_json.parent.mkdir(parents=True)
    mine = {"npm": "@ai-sdk/openai-compatible", "name": "Mine",
            "options": {"baseURL": "http://127.0.0.1:9/v1"}, "models": {"x": {"name": "x"}}}
    opencode_json.write_text(json.dumps({"provider": {"mine": mine}, "model": "mine/x"}))

    serve = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "serve", "--model", f"{MODEL_ID}={long_context_model}",
        "--host", "0.0.0.0", "--port", "0", "--parallel", "1", "--ctx-size", str(CONTEXT),
        "--threads", "1", "--max-output-tokens", str(OUTPUT_CAP), "--llama-server", str(llama_server_binary),
        "--advertise", PORT_NAME, env=owner, cwd=REPO, start_new_session=True,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    served: list[str] = []
    try:
        assert serve.stdout is not None
        announced = ("Announced on the LAN", "Could not announce")
        await read_until(serve.stdout, f"[ready] {MODEL_ID}", served)
        if not any(word in line for line in served for word in announced):  # it may come first
            await read_until(serve.stdout, announced, served)
        address = next(line.strip() for line in served if "//127.0.0.1:" in line)

        started = time.monotonic()  # the teammate has nothing yet
        connect = await start_connect(mate, PORT_NAME)
        said: list[str] = []
        assert connect.stdout is not None
        code_line = await read_until(connect.stdout, "Code: ", said, timeout=60, eof_ok=True)
        if not code_line:  # no multicast here: connect says so, and is given the address
            assert "multicast found nothing" in "".join(said), said
            print("\nmDNS found nothing on this machine: connecting by address")
            connect = await start_connect(mate, address)
            assert connect.stdout is not None
            code_line = await read_until(connect.stdout, "Code: ", said, timeout=60)
            assert any("Using the address given" in line for line in said), said
        else:
            assert any(f"Using {PORT_NAME}." in line for line in said), said  # found over mDNS
        code = code_line.split("Code: ", 1)[1].split()[0]
        assert connect.stdout is not None
        await read_until(connect.stdout, "Waiting for the owner", said)

        # The owner sees the request, with the code the teammate worked out on their side
        # (nothing relays the connection), and approves it by the code read out to them.
        listing = await (await gguf_studio(owner, "keys", "requests", "--json")).result()
        assert listing.returncode == 0, listing.describe()
        (request,) = json.loads(listing.stdout)
        assert (request["name"], request["code"]) == ("bob", code)
        assert request["address"]  # where the request came from, as the port saw it
        assert any(f"The port sees you as {request['address']}, as you are." in line
                   for line in said), said
        approval = await (await gguf_studio(owner, "keys", "approve", code,
                                            "--tokens-per-minute", "500000")).result()
        assert approval.returncode == 0, approval.describe()

        rest, _ = await asyncio.wait_for(connect.communicate(), 60)
        said.append(rest.decode(errors="replace"))
        assert connect.returncode == 0, "".join(said)
        # The profile is the port's: its announced name, or its address when given one.
        profile = "".join(said).split("Start Codex with: codex --profile ", 1)[1].split()[0]
        assert profile == PORT_NAME or profile.startswith("127-0-0-1-"), profile

        codex = await Process.start(
            [str(clients.codex_bin), "exec", "--strict-config", "--skip-git-repo-check",
             "--ephemeral", "--color", "never", "-C", str(tmp_path), "--profile", profile,
             "Say hello."], env={**mate, "CODEX_HOME": str(codex_home)}, cwd=tmp_path)
        run = await codex.result()
        elapsed = time.monotonic() - started
        print(f"\nfrom nothing to a working Codex run: {elapsed:.1f}s "
              f"(of which Codex {run.seconds:.1f}s)")

        assert run.returncode == 0 and not run.timed_out, run.describe()
        assert run.text, run.describe()
        assert elapsed < TARGET_SECONDS, f"{elapsed:.1f}s"
        # The key: in a 0600 file, in no config file; the files the teammate had: kept,
        # backed up where changed.
        key_file = Path(mate["XDG_CONFIG_HOME"]) / "gguf-studio" / "connections" / f"{profile}.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        secret = key_file.read_text().strip()
        assert secret.startswith("gs-")
        codex_profile = (codex_home / f"{profile}.config.toml").read_text()
        written = json.loads(opencode_json.read_text())
        assert secret not in codex_profile and secret not in opencode_json.read_text()
        assert (codex_home / "config.toml").read_text() == config_toml
        assert set(written["provider"]) == {"mine", profile} and written["model"] == "mine/x"
        assert "small_model" not in written  # OpenCode's own, for every provider: left alone
        assert list(opencode_json.parent.glob("opencode.json.bak-*"))
        assert secret not in "".join(said)  # never printed either

        # OpenCode with the file as connect left it (plus the suite's offline switches),
        # asked for the port's default model by the provider connect added.
        config = {**written, "autoupdate": False, "share": "disabled"}
        (first_model, *_) = written["provider"][profile]["models"]
        oc = await opencode.run(cast(StudioService, None), "Say hello.", config=config,
                                args=("-m", f"{profile}/{first_model}"))
        assert oc.returncode == 0 and not oc.timed_out, oc.describe()
        assert oc.text, oc.describe()
    finally:
        if serve.returncode is None:
            os.killpg(serve.pid, 2)
            try:
                await asyncio.wait_for(serve.wait(), 30)
            except asyncio.TimeoutError:
                os.killpg(serve.pid, 9)
                await serve.wait()
