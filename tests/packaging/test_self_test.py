"""`--self-test MODEL`: the headless coroutine, its command line and the bundle's entry."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.app.self_test import FAILED, PASSED, run_self_test
from backend.app.service import StudioService
from backend.settings import Settings
from backend.llama.load import State

ROOT = Path(__file__).resolve().parents[2]


def fake_engine(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fake-llama-server"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


async def self_test(model, **kwargs) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await run_self_test(model, out=out, err=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


async def test_loads_answers_through_its_own_port_and_reports(tiny_model, llama_server_binary):
    code, out, err = await self_test(tiny_model, llama_server=llama_server_binary)
    assert code == 0, err
    assert out.startswith(PASSED) and out.count("\n") == 1  # one summary line
    assert "tiny loaded" in out and "(1 slot, ctx 512)" in out
    assert "1 chat completion through port" in out
    assert err == ""


async def test_a_model_without_a_chat_template_is_tested_with_a_plain_prompt(
        gemma3_model, llama_server_binary):
    """Gemma 3 270M has no chat template: its port refuses chats, and takes prompts."""
    code, out, err = await self_test(gemma3_model, llama_server=llama_server_binary)
    assert code == 0, err
    assert "1 completion (no chat template) through port" in out


async def test_uses_a_given_service_and_leaves_it_open(tmp_path, tiny_model, llama_server_binary):
    """The window's path: its own service, on whatever port it has."""
    service = StudioService(Settings(port=0, llama_server=str(llama_server_binary)),
                            log_dir=tmp_path / "logs")
    try:
        code, out, err = await self_test(tiny_model, service=service)
        assert code == 0, err
        assert f"through port {service.gateway_port}" in out
        assert service.snapshot().state is State.STOPPED  # the model is unloaded again
        assert service.gateway_port is not None  # but the port stays open
    finally:
        await service.close()


async def test_missing_engine_is_a_clear_failure(tmp_path, tiny_model):
    code, out, err = await self_test(tiny_model, llama_server=tmp_path / "nope")
    assert code == 1 and out == ""
    assert err.startswith(FAILED) and "nope, does not exist" in err


async def test_engine_that_dies_while_loading_shows_its_log(tmp_path, tiny_model):
    engine = fake_engine(tmp_path, 'echo "cannot allocate the model" >&2\nexit 3')
    code, _, err = await self_test(tiny_model, llama_server=engine)
    assert code == 1
    assert err.startswith(f"{FAILED} the model did not load")
    assert "last lines of the llama-server log" in err and "cannot allocate the model" in err


async def test_not_a_model(tmp_path, llama_server_binary):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    code, _, err = await self_test(junk, llama_server=llama_server_binary)
    assert code == 1 and err.startswith(FAILED) and "junk.gguf" in err
    code, _, err = await self_test(tmp_path / "missing.gguf", llama_server=llama_server_binary)
    assert code == 1 and "no model file" in err


async def test_an_engine_that_never_becomes_ready_hits_the_timeout(tmp_path, tiny_model):
    engine = fake_engine(tmp_path, "exec sleep 600")
    code, _, err = await self_test(tiny_model, llama_server=engine, timeout=2)
    assert code == 1 and "did not finish within 2 s" in err


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    environ.update(QT_QPA_PLATFORM="offscreen", **env)
    return subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=ROOT, env=environ)


def test_command_line(tiny_model, llama_server_binary):
    result = _run([sys.executable, "-m", "backend.app.self_test", str(tiny_model),
                   "--llama-server", str(llama_server_binary)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(PASSED)


def test_engine_from_the_environment_like_the_app(tiny_model, llama_server_binary, tmp_path):
    result = _run([sys.executable, "-m", "backend.app.self_test", str(tiny_model)],
                  GGUF_STUDIO_LLAMA_SERVER=str(llama_server_binary),
                  GGUF_STUDIO_DATA_DIR=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    assert result.returncode == 0, result.stderr


def test_bundle_entry_point_dispatches_the_self_test(tiny_model, llama_server_binary):
    """packaging/entry.py unfrozen: the same code path the bundle runs."""
    result = _run([sys.executable, str(ROOT / "packaging" / "entry.py"),
                   "--self-test", str(tiny_model), "--llama-server", str(llama_server_binary)])
    assert result.returncode == 0, result.stderr
    assert PASSED in result.stdout
