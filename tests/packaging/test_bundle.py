"""The one-folder app: build it with PyInstaller and prove that it starts and works.

The build takes about a minute on 2 cores and happens once per checkout: it goes to
build/test-bundle/ (or $GGUF_STUDIO_BUNDLE_DIR) and is reused while the spec, the
sources and the installed packages are unchanged (packaging/build.py --reuse hashes them).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.app.self_test import FAILED, PASSED

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "packaging" / "build.py"

# The build itself can take minutes on a busy 2-core machine.
pytestmark = pytest.mark.timeout(1800)


def _load_build_module():
    # packaging/ is no Python package (the name belongs to PyPI's `packaging`): load by path.
    spec = importlib.util.spec_from_file_location("gguf_studio_build", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_script = _load_build_module()


@pytest.fixture(scope="session")
def bundle_dir() -> Path:
    base = Path(os.environ.get("GGUF_STUDIO_BUNDLE_DIR") or ROOT / "build" / "test-bundle")
    dist, work = base / "dist", base / "work"
    base.mkdir(parents=True, exist_ok=True)
    log = base / "build.log"
    with log.open("w") as out:
        result = subprocess.run(
            [sys.executable, str(BUILD_SCRIPT), "--reuse", "--quiet", "--dist", str(dist),
             "--work", str(work)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=1700)
    text = log.read_text()
    if result.returncode != 0:
        pytest.fail(f"the PyInstaller build failed (exit {result.returncode}); "
                    f"last lines of {log}:\n" + "\n".join(text.splitlines()[-40:]))
    exe = build_script.executable_path(dist)
    assert Path(text.strip().splitlines()[-1]) == exe
    return exe.parent


@pytest.fixture(scope="session")
def app(bundle_dir: Path) -> Path:
    return build_script.executable_path(bundle_dir.parent)


def run_app(app: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """The bundle as a user's desktop starts it: no venv, no PYTHONPATH, offscreen Qt."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("GGUF_STUDIO_", "PYTHON", "VIRTUAL_ENV"))}
    environ["PATH"] = os.pathsep.join(p for p in environ.get("PATH", "").split(os.pathsep)
                                      if ".venv" not in p)
    environ.update(QT_QPA_PLATFORM="offscreen", **env)
    return subprocess.run([str(app), *args], capture_output=True, text=True, timeout=240,
                          cwd=cwd, env=environ)


def test_built_app_passes_its_self_test(app, tiny_model, llama_server_binary, tmp_path):
    result = run_app(app, "--self-test", str(tiny_model), "--llama-server", str(llama_server_binary),
                     cwd=tmp_path, GGUF_STUDIO_DATA_DIR=str(tmp_path / "data"),
                     XDG_CONFIG_HOME=str(tmp_path / "config"))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = [line for line in result.stdout.splitlines() if line.startswith(PASSED)]
    assert len(summary) == 1, result.stdout + result.stderr
    assert "tiny loaded" in summary[0] and "1 chat completion through port" in summary[0]


def test_built_app_finds_the_engine_like_the_app_does(app, tiny_model, llama_server_binary, tmp_path):
    """No flag: the engine comes from GGUF_STUDIO_LLAMA_SERVER, as for the installed app."""
    result = run_app(app, "--self-test", str(tiny_model), cwd=tmp_path,
                     GGUF_STUDIO_LLAMA_SERVER=str(llama_server_binary),
                     GGUF_STUDIO_DATA_DIR=str(tmp_path / "data"),
                     XDG_CONFIG_HOME=str(tmp_path / "config"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert PASSED in result.stdout


def test_built_app_without_an_engine_fails_clearly(app, tiny_model, tmp_path):
    result = run_app(app, "--self-test", str(tiny_model), cwd=tmp_path,
                     GGUF_STUDIO_DATA_DIR=str(tmp_path / "empty-data"),
                     XDG_CONFIG_HOME=str(tmp_path / "config"), PATH="/usr/bin:/bin")
    assert result.returncode == 1
    assert FAILED in result.stderr and "No llama-server found" in result.stderr
    assert "Traceback" not in result.stderr


def test_built_app_installs_itself_in_the_menu(app, tmp_path):
    home = tmp_path / "share"
    result = run_app(app, "--install-desktop", "--data-home", str(home), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    entry = home / "applications" / "gguf-studio.desktop"
    assert f"Exec={app}\n" in entry.read_text()  # the bundle's own executable
    if shutil.which("desktop-file-validate"):
        check = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    assert (home / "icons/hicolor/scalable/apps/gguf-studio.svg").is_file()

    result = run_app(app, "--uninstall-desktop", "--data-home", str(home), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not entry.exists()


def test_bundle_carries_the_app_but_not_the_engine(bundle_dir):
    internal = bundle_dir / "_internal"
    assert (internal / "PySide6").is_dir()
    assert not list(bundle_dir.rglob("llama-server*"))  # resolved at run time, never bundled
    if (ROOT / "resources" / "icon.svg").is_file():
        assert (internal / "resources" / "icon.svg").read_bytes() == \
            (ROOT / "resources" / "icon.svg").read_bytes()
