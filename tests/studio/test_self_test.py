"""`gguf-studio-app --self-test MODEL`: the window, its own port, one answer, exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def self_test(model: Path, llama_server: Path, home: Path) -> subprocess.CompletedProcess:
    """`gguf-studio-app --self-test MODEL` in a private config and state dir."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(home / "config"),
               XDG_STATE_HOME=str(home / "state"))
    return subprocess.run(
        [sys.executable, "-m", "studio.app", "--self-test", str(model),
         "--llama-server", str(llama_server)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_window_self_test_answers_through_its_own_port_and_exits_0(tiny_model, llama_server_binary,
                                                                    tmp_path):
    done = self_test(tiny_model, llama_server_binary, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("GGUF Studio self-test passed: tiny loaded")
    assert "1 chat completion through port" in done.stdout


def test_window_self_test_fails_clearly_on_a_broken_model(tmp_path, llama_server_binary):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model")
    done = self_test(broken, llama_server_binary, tmp_path)
    assert done.returncode == 1
    assert "self-test FAILED" in done.stderr and "broken.gguf" in done.stderr
    assert "Traceback" not in done.stderr
