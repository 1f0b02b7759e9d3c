"""Quitting while the Chat tab streams an answer: the app exits 0 and the engine is gone.

A child process, as in test_exit_path.py: the failure this guards against (an abort in the
interpreter's teardown after network traffic, or a stream left running on a closed loop)
comes after Python code has stopped running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.studio.conftest import free_port, private_environment
from tests.studio.test_exit_path import REPO, _is_zombie_or_gone


def test_quitting_while_the_chat_streams_exits_cleanly(tmp_path: Path, llama_server_binary: Path,
                                                      tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(private_environment(tmp_path))
    env["GGUF_STUDIO_LLAMA_SERVER"] = str(llama_server_binary)
    env["GGUF_STUDIO_PORT"] = str(free_port())
    env["PYTHONPATH"] = str(REPO)

    done = subprocess.run([sys.executable, "-m", "tests.studio.chat_exit_probe", str(tiny_model)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)

    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr and "ERROR" not in done.stderr, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, done.stdout + done.stderr[-3000:]
    assert reports[0]["shown"] > 200
    assert reports[0]["pid"] and _is_zombie_or_gone(reports[0]["pid"])
