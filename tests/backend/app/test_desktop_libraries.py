"""The window names the X11 libraries it lacks instead of letting Qt abort.

A missing system library is simulated honestly: a copy of PySide6's real xcb platform
plugin whose need for libxcb-icccm.so.4 is renamed to a library no system has
(libxcb-icccz.so.4, same length, so the ELF stays valid).  Qt is pointed at it with its
own QT_QPA_PLATFORM_PLUGIN_PATH; the control run shows Qt itself aborts on it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.app.desktop_libraries import (install_line, missing_libraries, missing_packages,
                                       platform_problem, uses_xcb, xcb_plugin)
from tests.not_none import not_none

ROOT = Path(__file__).resolve().parents[3]
REAL_NEED, FAKE_NEED = b"libxcb-icccm.so.4", b"libxcb-icccz.so.4"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ldd") is None,
                                reason="X11 plugin libraries: Linux with ldd")


@pytest.fixture
def broken_plugin_env(tmp_path: Path) -> dict[str, str]:
    real = xcb_plugin({})
    assert real is not None, "PySide6 ships libqxcb.so"
    data = real.read_bytes()
    assert data.count(REAL_NEED) == 1
    platforms = tmp_path / "platforms"
    platforms.mkdir()
    (platforms / real.name).write_bytes(data.replace(REAL_NEED, FAKE_NEED))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GGUF_STUDIO_", "QT_"))}
    env.update(QT_QPA_PLATFORM="xcb", QT_QPA_PLATFORM_PLUGIN_PATH=str(platforms),
               DISPLAY=":0", XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_STATE_HOME=str(tmp_path / "state"),
               # Qt's own libraries, which the copy no longer finds beside itself.
               LD_LIBRARY_PATH=str(real.parents[2] / "lib"), PYTHONPATH=str(ROOT))
    return env


def test_qt_itself_aborts_on_the_plugin_without_naming_the_library(broken_plugin_env):
    done = subprocess.run([sys.executable, "-c", "from PySide6.QtWidgets import QApplication; "
                           "QApplication([])"], env=broken_plugin_env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert 'Could not load the Qt platform plugin "xcb"' in done.stderr
    assert FAKE_NEED.decode() not in done.stderr


def test_the_window_names_the_missing_library_and_exits_cleanly(broken_plugin_env):
    done = subprocess.run([sys.executable, "-m", "studio.app"], cwd=ROOT, env=broken_plugin_env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "missing: libxcb-icccz.so.4." in done.stderr
    assert "Could not load the Qt platform plugin" not in done.stderr
    assert "Traceback" not in done.stderr
    assert "gguf-studio serve --model MODEL" in done.stderr


def test_missing_libraries_are_read_from_the_loader(broken_plugin_env):
    plugin = Path(broken_plugin_env["QT_QPA_PLATFORM_PLUGIN_PATH"]) / "libqxcb.so"
    assert xcb_plugin(broken_plugin_env) == plugin
    assert missing_libraries(plugin, broken_plugin_env) == ["libxcb-icccz.so.4"]
    assert "libxcb-icccz.so.4" in not_none(platform_problem(broken_plugin_env))
    assert platform_problem(dict(broken_plugin_env, QT_QPA_PLATFORM="offscreen")) is None


def test_the_install_line_names_the_debian_packages():
    missing = ["libxcb-keysyms.so.1", "libxcb-icccm.so.4"]
    assert missing_packages(missing) == ["libxcb-icccm4", "libxcb-keysyms1"]
    if shutil.which("apt-get"):
        assert install_line(missing) == "sudo apt-get install libxcb-icccm4 libxcb-keysyms1"
    assert "libfoo.so.1" in install_line(["libfoo.so.1"])


def test_qt_picks_xcb_unless_told_otherwise_or_in_a_wayland_session():
    assert uses_xcb({})
    assert uses_xcb({"QT_QPA_PLATFORM": "xcb:nograb"})
    assert not uses_xcb({"QT_QPA_PLATFORM": "offscreen"})
    assert not uses_xcb({"QT_QPA_PLATFORM": "wayland;xcb"})
    assert not uses_xcb({"XDG_SESSION_TYPE": "wayland", "WAYLAND_DISPLAY": "wayland-0"})
