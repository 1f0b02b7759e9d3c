"""The freedesktop menu entry: what it says, where it goes, and that it validates."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from backend.app import desktop_entry
from backend.app.desktop_entry import DesktopEntryError, install, uninstall

VALIDATOR = shutil.which("desktop-file-validate")
needs_validator = pytest.mark.skipif(
    VALIDATOR is None,
    reason="desktop-file-validate is not installed: install Debian's desktop-file-utils "
           "(apt-get install -y desktop-file-utils; scripts/setup does this for tests)")


def validate(path: Path) -> None:
    """desktop-file-validate accepts the file: no error and no warning (hints are advice)."""
    assert VALIDATOR is not None  # the tests that call this are skipped without it
    result = subprocess.run([VALIDATOR, str(path)], capture_output=True, text=True)
    output = (result.stdout + result.stderr).strip()
    problems = [line for line in output.splitlines() if ": error: " in line or ": warning: " in line]
    assert result.returncode == 0 and not problems, output


def read_entry(path: Path) -> dict[str, str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "[Desktop Entry]"
    return dict(line.split("=", 1) for line in lines[1:] if line and not line.startswith("#"))


def unescape_string(value: str) -> str:
    """The string-value escapes of the Desktop Entry Specification."""
    out, i = [], 0
    while i < len(value):
        c = value[i]
        if c == "\\" and i + 1 < len(value):
            out.append({"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}.get(value[i + 1], "\\" + value[i + 1]))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_exec(value: str) -> list[str]:
    """An Exec= value back into argv, by the specification's rules (no field codes used)."""
    text = unescape_string(value)
    args, current, quoted, i, started = [], [], False, 0, False
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\" and i + 1 < len(text) and text[i + 1] in '"`$\\':
                current.append(text[i + 1])
                i += 1
            elif c == '"':
                quoted = False
            else:
                current.append(c)
        elif c == '"':
            quoted, started = True, True
        elif c == " ":
            if started or current:
                args.append("".join(current))
            current, started = [], False
        else:
            current.append(c)
        i += 1
    assert not quoted, f"unbalanced quotes in {value!r}"
    if started or current:
        args.append("".join(current))
    return [a.replace("%%", "%") for a in args]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder under root."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def program(tmp_path: Path) -> Path:
    """An executable that records the arguments it was started with."""
    folder = tmp_path / "app dir"
    folder.mkdir()
    path = folder / "gguf-studio-app"
    path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    "open(sys.argv[0] + '.ran', 'w').write(json.dumps(sys.argv[1:]))\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --- the entry ---------------------------------------------------------------------


@needs_validator
def test_installed_entry_validates_and_says_what_the_menu_needs(tmp_path, program):
    home = tmp_path / "share"
    written = install(home, [str(program)])

    assert written == [home / "applications" / "gguf-studio.desktop",
                       home / "icons" / "hicolor" / "scalable" / "apps" / "gguf-studio.svg"]
    validate(written[0])
    entry = read_entry(written[0])
    assert entry["Type"] == "Application"
    assert entry["Name"] == "GGUF Studio"
    assert parse_exec(entry["Exec"]) == [str(program)]
    assert unescape_string(entry["TryExec"]) == str(program)
    assert entry["Icon"] == "gguf-studio"  # found by name in the hicolor theme
    assert entry["Categories"] == "Development;Utility;"
    assert entry["Terminal"] == "false"
    assert entry["StartupWMClass"] == desktop_entry.APP_ID
    assert oct(written[0].stat().st_mode & 0o777) == "0o644"


@needs_validator
def test_an_awkward_command_is_quoted_so_that_it_runs_as_given(tmp_path, program):
    weird = program.parent / 'x $HOME "q" `b` 50%\\z'
    shutil.copy2(program, weird)
    argv = [str(weird), "--model", "/models/my model.gguf", "a;b&c|d", "100%"]
    path = install(tmp_path / "share", argv)[0]
    validate(path)

    parsed = parse_exec(read_entry(path)["Exec"])
    assert parsed == argv
    subprocess.run(parsed, check=True, timeout=30)  # what a desktop would run
    assert Path(str(weird) + ".ran").read_text() == '["--model", "/models/my model.gguf", "a;b&c|d", "100%"]'


def test_the_icon_is_the_apps_svg(tmp_path, program):
    svg = install(tmp_path / "share", [str(program)])[1]
    source = desktop_entry.find_icon_source()
    if source is not None:
        assert svg.read_bytes() == source.read_bytes()
    else:  # resources/icon.svg not shipped: the built-in one, still a valid SVG
        assert svg.read_text() == desktop_entry.FALLBACK_ICON
    root = ET.fromstring(svg.read_bytes())
    assert root.tag.endswith("svg")


def test_an_icon_can_be_given(tmp_path, program):
    icon = tmp_path / "mine.svg"
    icon.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"/>')
    svg = install(tmp_path / "share", [str(program)], icon_source=icon)[1]
    assert svg.read_bytes() == icon.read_bytes()


def test_relative_program_is_refused(tmp_path):
    with pytest.raises(DesktopEntryError, match="absolute"):
        install(tmp_path / "share", ["gguf-studio-app"])
    assert not (tmp_path / "share").exists()


# --- where it goes ---------------------------------------------------------------------


def test_xdg_data_home_is_respected(tmp_path, monkeypatch, program):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    written = install(exec_command=[str(program)])
    assert all(p.is_relative_to(tmp_path / "xdg") for p in written)
    assert uninstall() == written


def test_without_xdg_data_home_it_is_home_local_share(tmp_path, monkeypatch, program):
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (None, "", "relative/dir"):  # unset, empty and relative all mean the default
        if value is None:
            monkeypatch.delenv("XDG_DATA_HOME", raising=False)
        else:
            monkeypatch.setenv("XDG_DATA_HOME", value)
        assert desktop_entry.data_home() == tmp_path / ".local" / "share"
    written = install(exec_command=str(program))
    assert written[0] == tmp_path / ".local/share/applications/gguf-studio.desktop"


# --- install twice, uninstall --------------------------------------------------------------


def test_install_is_idempotent(tmp_path, program):
    home = tmp_path / "share"
    first = install(home, [str(program)])
    before = tree(home)
    assert install(home, [str(program)]) == first
    assert tree(home) == before  # no leftovers (temporary files), same bytes


def test_uninstall_removes_exactly_what_install_wrote(tmp_path, program):
    home = tmp_path / "share"
    # A data dir in use: other apps' entries and icons, an icon theme index.
    (home / "applications").mkdir(parents=True)
    (home / "applications" / "other.desktop").write_text("[Desktop Entry]\nType=Application\n")
    (home / "icons" / "hicolor").mkdir(parents=True)
    (home / "icons" / "hicolor" / "index.theme").write_text("[Icon Theme]\n")
    before = tree(home)

    written = install(home, [str(program)])
    assert set(tree(home)) > set(before)
    assert sorted(uninstall(home)) == sorted(written)
    assert tree(home) == before  # folders install made are gone again; nothing else moved

    assert uninstall(home) == []  # and again: nothing to do


def test_uninstall_on_an_empty_data_dir_leaves_nothing_behind(tmp_path, program):
    home = tmp_path / "share"
    install(home, [str(program)])
    uninstall(home)
    assert tree(home) == {}
    assert home.is_dir()  # the data dir itself is never removed


def test_uninstall_leaves_a_hand_made_entry_alone(tmp_path):
    home = tmp_path / "share"
    mine = home / "applications" / "gguf-studio.desktop"
    mine.parent.mkdir(parents=True)
    mine.write_text("[Desktop Entry]\nType=Application\nName=Mine\nExec=/bin/true\n")
    with pytest.raises(DesktopEntryError, match="not written by"):
        uninstall(home)
    assert mine.is_file()


# --- the command that goes in Exec ------------------------------------------------------------


def test_default_command_is_the_absolute_gui_entry_point():
    command = desktop_entry.default_exec_command()
    program = Path(command[0])
    assert program.is_absolute() and os.access(program, os.X_OK)
    if program.name.startswith("gguf-studio-app"):
        assert command == [str(program)]
    else:  # an installation without its scripts
        assert command[1:] == ["-m", "launcher"]


def test_venv_script_is_found_without_resolving_the_venv_python():
    """A venv's python is a symlink to the base interpreter; the script sits next to the link."""
    script = Path(sys.executable).absolute().parent / "gguf-studio-app"
    if not script.is_file():
        pytest.skip(f"{script} is not installed (pip install -e . creates it)")
    assert desktop_entry.default_exec_command() == [str(script)]


def test_frozen_app_uses_its_own_executable(monkeypatch, tmp_path):
    exe = tmp_path / "bundle" / "gguf-studio"
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", str(exe))
    assert desktop_entry.default_exec_command() == [str(exe)]


# --- command line ------------------------------------------------------------------------------


def test_cli_install_and_uninstall(tmp_path, capsys, monkeypatch, program):
    if sys.platform in {"win32", "darwin"}:
        pytest.skip("desktop entries are for Linux and BSD desktops")
    monkeypatch.setattr(desktop_entry, "default_exec_command", lambda: [str(program)])
    args = argparse.Namespace(data_home=str(tmp_path / "share"))

    assert desktop_entry.cli_install(args) == 0
    out = capsys.readouterr().out
    assert "gguf-studio.desktop" in out and "gguf-studio.svg" in out
    assert desktop_entry.cli_uninstall(args) == 0
    assert "removed" in capsys.readouterr().out
    assert desktop_entry.cli_uninstall(args) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_cli_reports_a_refusal_without_a_traceback(tmp_path, capsys):
    home = tmp_path / "share"
    (home / "applications").mkdir(parents=True)
    (home / "applications" / "gguf-studio.desktop").write_text("[Desktop Entry]\n")
    assert desktop_entry.cli_uninstall(argparse.Namespace(data_home=str(home))) == 1
    assert "not written by gguf-studio install-desktop" in capsys.readouterr().err


def test_add_arguments_gives_data_home():
    parser = argparse.ArgumentParser()
    desktop_entry.add_arguments(parser)
    assert parser.parse_args(["--data-home", "/x"]).data_home == "/x"
    assert parser.parse_args([]).data_home is None
