"""The freedesktop menu entry: `gguf-studio install-desktop` and `uninstall-desktop`.

Writes two files into the user's data dir ($XDG_DATA_HOME, by default ~/.local/share):

    applications/gguf-studio.desktop              the menu entry that starts the window
    icons/hicolor/scalable/apps/gguf-studio.svg   its icon, found by name (Icon=gguf-studio)

`Exec=` is the absolute path of the `gguf-studio-app` GUI entry point of the running
installation (the bundle's own executable when running from a PyInstaller build), so
the entry starts the same GGUF Studio that installed it.  Installing again rewrites
the same two files; uninstalling removes exactly those two files and nothing else.

Qt ties a window to this entry through its WM_CLASS (X11) or app id (Wayland): the
window sets `QGuiApplication.setApplicationName(APP_ID)` and `setDesktopFileName(APP_ID)`,
which match `StartupWMClass=` and the entry's file name.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Mapping, Sequence

APP_ID = "gguf-studio"
APP_NAME = "GGUF Studio"
GUI_SCRIPT = "gguf-studio-app"
DESKTOP_FILE = f"{APP_ID}.desktop"
ICON_FILE = f"{APP_ID}.svg"
# Marks entries written by this module, so that uninstall leaves a hand-made one alone.
MARKER_KEY = "X-GGUF-Studio-Installer"
MARKER = "gguf-studio install-desktop"

# Used when resources/icon.svg is not shipped with this installation (a wheel carries
# only the Python packages): a plain, valid icon beats a menu entry without one.
FALLBACK_ICON = """\
<svg xmlns="http://www.w3.org/2000/svg" width="128" height="128" viewBox="0 0 128 128">
  <rect x="8" y="8" width="112" height="112" rx="24" fill="#2b5797"/>
  <text x="64" y="78" font-family="sans-serif" font-size="40" font-weight="bold"
        text-anchor="middle" fill="#ffffff">GGUF</text>
</svg>
"""


class DesktopEntryError(Exception):
    """Installing or removing the desktop entry cannot be done as asked."""


# --- where things go ----------------------------------------------------------------


def data_home(environ: Mapping[str, str] | None = None) -> Path:
    """$XDG_DATA_HOME, or ~/.local/share when it is unset, empty or relative (XDG spec)."""
    environ = os.environ if environ is None else environ
    value = environ.get("XDG_DATA_HOME", "")
    if value and os.path.isabs(value):
        return Path(value)
    return Path(environ.get("HOME") or Path.home()) / ".local" / "share"


def desktop_file_path(home: Path) -> Path:
    return Path(home) / "applications" / DESKTOP_FILE


def icon_path(home: Path) -> Path:
    return Path(home) / "icons" / "hicolor" / "scalable" / "apps" / ICON_FILE


def installed_paths(home: str | os.PathLike[str] | None = None) -> list[Path]:
    """The files `install` writes (whether or not they exist now)."""
    home = Path(home) if home is not None else data_home()
    return [desktop_file_path(home), icon_path(home)]


# --- what goes in them ----------------------------------------------------------------


def default_exec_command() -> list[str]:
    """The command that opens the window of the running installation, absolute paths only."""
    if getattr(sys, "frozen", False):  # a PyInstaller bundle: its executable is the app
        return [str(Path(sys.executable).absolute())]
    # Not resolved: a venv's python is a symlink, and its scripts live next to the link.
    candidates = [Path(sys.executable).absolute().parent / _script_name(),
                  Path(sysconfig.get_path("scripts")) / _script_name()]
    found = shutil.which(GUI_SCRIPT)
    if found:
        candidates.append(Path(found).absolute())
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return [str(path)]
    # An installation without its scripts (e.g. run from a source checkout): the command
    # line opens the window when given no command.
    return [str(Path(sys.executable).absolute()), "-m", "launcher"]


def find_icon_source() -> Path | None:
    """resources/icon.svg of this installation (the bundle's copy when frozen)."""
    roots = []
    bundle_root = getattr(sys, "_MEIPASS", None)
    if bundle_root:
        roots.append(Path(bundle_root))
    roots.append(Path(__file__).resolve().parents[2])
    for root in roots:
        path = root / "resources" / "icon.svg"
        if path.is_file():
            return path
    return None


def render_desktop_entry(exec_command: Sequence[str]) -> str:
    """The text of the .desktop file for `exec_command` (argv, first item absolute)."""
    if not exec_command:
        raise DesktopEntryError("The command to start GGUF Studio is empty.")
    program = str(exec_command[0])
    if not os.path.isabs(program):
        raise DesktopEntryError(f"The program in Exec= must be an absolute path, not {program!r}.")
    exec_line = " ".join(_quote_exec_arg(str(arg)) for arg in exec_command)
    lines = [
        "[Desktop Entry]",
        "Type=Application",
        "Version=1.4",  # the newest that desktop-file-utils 0.26 (Debian 12) knows
        f"Name={APP_NAME}",
        "GenericName=Local model server",
        "Comment=Share a local GGUF model with the people and coding agents on your network",
        f"TryExec={_escape_string(program)}",
        f"Exec={_escape_string(exec_line)}",
        f"Icon={APP_ID}",
        "Terminal=false",
        "Categories=Development;Utility;",
        "Keywords=LLM;GGUF;llama;llama.cpp;OpenAI;inference;server;",
        "StartupNotify=true",
        f"StartupWMClass={APP_ID}",
        f"{MARKER_KEY}={MARKER}",
    ]
    return "\n".join(lines) + "\n"


# Characters that make an Exec argument need quoting (Desktop Entry Spec, "The Exec key").
_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")
_ESCAPED_IN_QUOTES = set('"`$\\')


def _quote_exec_arg(arg: str) -> str:
    if "%" in arg:
        arg = arg.replace("%", "%%")  # a literal percent, not a field code
    if arg and not (set(arg) & _RESERVED):
        return arg
    if "\n" in arg:
        raise DesktopEntryError("A command-line argument with a line break cannot go in Exec=.")
    return '"' + "".join("\\" + c if c in _ESCAPED_IN_QUOTES else c for c in arg) + '"'


def _escape_string(value: str) -> str:
    """The string-value escapes every key of a desktop file gets (\\\\ \\n \\t \\r)."""
    return (value.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
            .replace("\r", "\\r"))


# --- install / uninstall ----------------------------------------------------------------


def install(data_home: str | os.PathLike[str] | None = None,
            exec_command: Sequence[str] | str | None = None,
            icon_source: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write the desktop entry and its icon; returns the files written.

    `data_home` defaults to $XDG_DATA_HOME (or ~/.local/share); `exec_command` to the
    running installation's GUI entry point (a string is one program path, a list is an
    argv).  Running it again rewrites the same files.
    """
    home = Path(data_home) if data_home is not None else _default_data_home()
    if exec_command is None:
        command = default_exec_command()
    elif isinstance(exec_command, (str, os.PathLike)):
        command = [str(exec_command)]
    else:
        command = [str(a) for a in exec_command]
    entry = render_desktop_entry(command)
    source = Path(icon_source) if icon_source is not None else find_icon_source()
    icon = source.read_bytes() if source is not None else FALLBACK_ICON.encode()

    desktop_path, svg_path = installed_paths(home)
    _write_atomically(svg_path, icon, mode=0o644)
    # The entry last: once it shows up in a menu, its icon is already there.
    _write_atomically(desktop_path, entry.encode(), mode=0o644)
    return [desktop_path, svg_path]


def uninstall(data_home: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove what `install` wrote; returns the files removed (none if not installed).

    A gguf-studio.desktop that `install` did not write (no installer mark) is left alone,
    and so is every folder that still holds anything.
    """
    home = Path(data_home) if data_home is not None else _default_data_home()
    desktop_path, svg_path = installed_paths(home)
    removed = []
    if desktop_path.is_file():
        if not is_ours(desktop_path):
            raise DesktopEntryError(
                f"{desktop_path} was not written by gguf-studio install-desktop; "
                "remove it yourself if you want it gone.")
        desktop_path.unlink()
        removed.append(desktop_path)
    if svg_path.is_file():
        svg_path.unlink()
        removed.append(svg_path)
    for path in removed:
        _remove_empty_parents(path.parent, stop=home)
    return removed


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    """Remove the folders `install` may have made, as long as they are empty."""
    stop = stop.absolute()
    folder = folder.absolute()
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()  # only ever succeeds on an empty folder
        except OSError:
            return
        folder = folder.parent


def is_ours(desktop_path: Path) -> bool:
    try:
        text = desktop_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return f"\n{MARKER_KEY}={MARKER}\n" in "\n" + text


def _default_data_home() -> Path:
    return data_home()


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _script_name() -> str:
    return GUI_SCRIPT + (".exe" if os.name == "nt" else "")


# --- command line -----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both commands take."""
    parser.add_argument("--data-home", metavar="DIR",
                        help="data dir to install into (default $XDG_DATA_HOME or ~/.local/share)")


def _check_platform() -> None:
    if sys.platform in {"win32", "darwin"}:
        raise DesktopEntryError(
            "Desktop entries are for Linux and BSD desktops. On Windows and macOS use the app "
            "bundle built by packaging/build.py (see packaging/README.md).")


def cli_install(args: argparse.Namespace) -> int:
    """`gguf-studio install-desktop [--data-home DIR]`"""
    try:
        _check_platform()
        written = install(getattr(args, "data_home", None))
    except (DesktopEntryError, OSError) as exc:
        print(f"gguf-studio: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    print(f"{APP_NAME} is now in your desktop's application menu "
          "(some desktops show it after the next log-in).")
    return 0


def cli_uninstall(args: argparse.Namespace) -> int:
    """`gguf-studio uninstall-desktop [--data-home DIR]`"""
    try:
        _check_platform()
        removed = uninstall(getattr(args, "data_home", None))
    except (DesktopEntryError, OSError) as exc:
        print(f"gguf-studio: {exc}", file=sys.stderr)
        return 1
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print("The desktop entry was not installed; nothing to remove.")
    return 0
