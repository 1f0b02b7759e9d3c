"""`gguf-studio-app --self-test MODEL`: the window, its own port, one answer, exit 0."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]


def self_test(model: Path, llama_server: Path, home: Path,
              **display: str) -> subprocess.CompletedProcess:
    """`gguf-studio-app --self-test MODEL` in a private config and state dir; offscreen
    unless `display` says otherwise (QT_QPA_PLATFORM, DISPLAY)."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(home / "config"),
               XDG_STATE_HOME=str(home / "state"))
    env.update(display)
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


@pytest.fixture
def x_display() -> Iterator[str]:
    """A real X server (Xvfb) on a display it picks free itself; its DISPLAY value."""
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (scripts/setup test installs it where it can)")
    read_end, write_end = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write_end), "-nolisten", "tcp",
                               "-screen", "0", "1600x1000x24"],
                              pass_fds=(write_end,), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    os.close(write_end)
    try:
        # Xvfb writes the display number once it accepts clients.
        ready, _, _ = select.select([read_end], [], [], 30)
        number = os.read(read_end, 64).decode().strip() if ready else ""
        if not number:
            server.kill()
            pytest.fail("Xvfb did not start: " + server.communicate()[1].decode()[-2000:])
        yield f":{number}"
    finally:
        os.close(read_end)
        server.terminate()
        server.wait(10)
        if server.stderr:
            server.stderr.close()


def test_window_self_test_runs_on_a_real_x_server(tiny_model, llama_server_binary, tmp_path,
                                                  x_display):
    """The xcb plugin the desktop uses (not offscreen): the window opens, loads, answers."""
    done = self_test(tiny_model, llama_server_binary, tmp_path,
                     QT_QPA_PLATFORM="xcb", DISPLAY=x_display)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("GGUF Studio self-test passed: tiny loaded")
    assert "Could not load the Qt platform plugin" not in done.stderr
