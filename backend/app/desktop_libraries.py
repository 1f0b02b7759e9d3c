"""The system libraries Qt's X11 platform plugin (xcb) needs, checked before Qt is.

Qt aborts the process ("Could not load the Qt platform plugin "xcb"") when a library
of its xcb plugin is missing, which fresh Debian/Ubuntu desktops lack (libxcb-icccm4,
libxcb-keysyms1, ...), and the message does not say which.  Before the window creates
its QApplication, `platform_problem` asks the dynamic loader (`ldd`, which honours
LD_LIBRARY_PATH as the loader will) what the plugin Qt is about to load cannot find,
and returns a message naming the libraries and the exact install line.  It looks where
Qt looks: `QT_QPA_PLATFORM_PLUGIN_PATH` first, then PySide6's own plugins.

`python -m backend.app.desktop_libraries` prints the Debian packages still missing, one
line, empty when none (scripts/setup installs them).  Nothing here imports Qt.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping

__all__ = ["XCB_PACKAGES", "install_line", "missing_libraries", "missing_packages",
           "platform_problem", "uses_xcb", "xcb_plugin"]

#: Library of the xcb plugin (and of libQt6XcbQpa) -> the Debian/Ubuntu package with it.
XCB_PACKAGES = {
    "libxcb.so.1": "libxcb1",
    "libX11.so.6": "libx11-6",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
}
PLUGIN_NAME = "libqxcb.so"


def uses_xcb(environ: Mapping[str, str]) -> bool:
    """Whether Qt will try its xcb plugin first (Linux and other X11 systems)."""
    if not sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
        return False
    chosen = environ.get("QT_QPA_PLATFORM", "").split(";")[0].strip()
    if chosen:
        return chosen.split(":")[0] == "xcb"
    # Qt prefers Wayland in a Wayland session and xcb everywhere else.
    return not (environ.get("XDG_SESSION_TYPE") == "wayland" and environ.get("WAYLAND_DISPLAY"))


def xcb_plugin(environ: Mapping[str, str]) -> Path | None:
    """The xcb platform plugin Qt would load, or None if there is none to check."""
    dirs = [Path(d) for d in environ.get("QT_QPA_PLATFORM_PLUGIN_PATH", "").split(os.pathsep) if d]
    spec = importlib.util.find_spec("PySide6")  # finds the package, imports no Qt
    for location in (spec.submodule_search_locations or []) if spec else []:
        dirs.append(Path(location) / "Qt" / "plugins" / "platforms")
    for directory in dirs:
        if (directory / PLUGIN_NAME).is_file():
            return directory / PLUGIN_NAME
    return None


def missing_libraries(binary: Path, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The libraries `binary` needs (directly or through its own libraries) that the
    loader cannot find; None when `ldd` is not there to ask."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return None
    try:
        out = subprocess.run([ldd, str(binary)], capture_output=True, text=True, timeout=20,
                             env=dict(os.environ if environ is None else environ)).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    missing = []
    for line in out.splitlines():
        name, arrow, where = line.strip().partition("=>")
        if arrow and where.strip() == "not found" and name.strip() not in missing:
            missing.append(name.strip())
    return missing


def missing_packages(missing: list[str]) -> list[str]:
    """Debian packages holding `missing` (libraries outside the known set are skipped)."""
    return sorted({XCB_PACKAGES[name] for name in missing if name in XCB_PACKAGES})


def install_line(missing: list[str]) -> str:
    packages = missing_packages(missing)
    if packages and shutil.which("apt-get"):
        return "sudo apt-get install " + " ".join(packages)
    return "install your system's packages that provide " + ", ".join(missing)


def platform_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """A message for the person starting the window, if Qt's xcb plugin cannot load
    for want of libraries; None when it can (or when that cannot be known)."""
    environ = os.environ if environ is None else environ
    if not uses_xcb(environ):
        return None
    plugin = xcb_plugin(environ)
    if plugin is None:
        return None
    missing = missing_libraries(plugin, environ)
    if not missing:
        return None
    return ("GGUF Studio cannot open its window: Qt's X11 platform plugin (xcb) needs "
            f"system libraries that are missing: {', '.join(missing)}.\n"
            f"Install them with:\n  {install_line(missing)}\n"
            "(scripts/setup does this when run as root.)  Without a window, the model can "
            "still be shared: gguf-studio serve --model MODEL.")


def _main() -> int:
    plugin = xcb_plugin(os.environ)
    missing = missing_libraries(plugin) if plugin else None
    print(" ".join(missing_packages(missing or [])))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
