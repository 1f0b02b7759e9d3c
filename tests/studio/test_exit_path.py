"""The app's exit path: serve traffic through the port, quit, and exit 0 with the engine gone.

The app runs as a child process because the failure this guards against (an abort in
the interpreter's teardown after network traffic, exit 134) happens after Python code
has stopped running, where no in-process test can see it.  The probe also measures how
late the Qt loop runs; `bench/qt_lag.py` reports that figure (speed is a benchmark's
business, not a test's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.studio.conftest import free_port, private_environment

REPO = Path(__file__).resolve().parents[2]
STREAMS = 64


def test_serving_then_quitting_exits_cleanly(tmp_path: Path, llama_server_binary: Path,
                                            tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(private_environment(tmp_path))
    env["GGUF_STUDIO_LLAMA_SERVER"] = str(llama_server_binary)
    env["GGUF_STUDIO_PORT"] = str(free_port())
    env["PYTHONPATH"] = str(REPO)

    done = subprocess.run(
        [sys.executable, "-m", "tests.studio.exit_probe", str(tiny_model), str(STREAMS), "32"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert reports, done.stdout + done.stderr[-3000:]
    report = reports[0]
    # Nothing was running any more when the window closed: it must not have asked.
    assert len(reports) == 1, reports
    assert report["statuses"] == [200] * STREAMS
    # The engine did not outlive the app.
    assert report["pid"] and _is_zombie_or_gone(report["pid"])


def _is_zombie_or_gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "State:\tZ" in status
