#!/usr/bin/env python3
"""Build the one-folder GGUF Studio app with PyInstaller.

    python packaging/build.py [--reuse] [--clean] [--dist DIR] [--work DIR]

Installs the pinned PyInstaller into the running environment when it is missing
(re-running itself with the checkout's .venv when started by a Python outside any
virtual environment), then builds packaging/gguf-studio.spec into build/dist/gguf-studio/
(work files in build/work/).  The last line printed is the executable's path.

--reuse skips the build when the previous one was made from the same inputs: the spec,
this script, the entry point, every file of backend/, studio/ and resources/,
pyproject.toml, and the Python and package versions of the environment.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

PYINSTALLER_VERSION = "6.22.3"
HOOKS_CONTRIB_VERSION = "2026.9"

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "packaging" / "gguf-studio.spec"
APP_NAME = "gguf-studio"
DEFAULT_DIST = ROOT / "build" / "dist"
DEFAULT_WORK = ROOT / "build" / "work"
STAMP_NAME = f".{APP_NAME}.build-stamp"

# Everything whose change must give a new bundle.
INPUT_FILES = ("packaging/gguf-studio.spec", "packaging/build.py", "packaging/entry.py",
               "pyproject.toml")
INPUT_DIRS = ("backend", "studio", "resources")


def executable_path(dist: Path = DEFAULT_DIST) -> Path:
    return Path(dist) / APP_NAME / (APP_NAME + (".exe" if os.name == "nt" else ""))


def inputs_digest(root: Path = ROOT) -> str:
    """A hash of everything the bundle is made from."""
    h = hashlib.sha256()
    files = [root / name for name in INPUT_FILES]
    for folder in INPUT_DIRS:
        base = root / folder
        if base.is_dir():
            files.extend(p for p in base.rglob("*")
                         if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    for path in sorted(set(files)):
        if not path.is_file():
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    h.update(f"{sys.version}|{platform.platform()}|{sys.prefix}".encode())
    dists = sorted(f"{d.metadata['Name']}=={d.version}".lower()
                   for d in importlib.metadata.distributions() if d.metadata["Name"])
    h.update("\n".join(dists).encode())
    return h.hexdigest()


def bundle_size(folder: Path) -> int:
    """Bytes on disk, each file once (the bundle links some libraries under two names)."""
    return sum(p.lstat().st_size for p in Path(folder).rglob("*")
               if p.is_file() and not p.is_symlink())


def is_up_to_date(dist: Path = DEFAULT_DIST, digest: str | None = None) -> bool:
    stamp = Path(dist) / STAMP_NAME
    exe = executable_path(dist)
    if not (stamp.is_file() and exe.is_file()):
        return False
    return stamp.read_text().strip() == (digest or inputs_digest())


def ensure_pyinstaller() -> None:
    """Install the pinned PyInstaller into this environment unless it is there already."""
    wanted = {"pyinstaller": PYINSTALLER_VERSION, "pyinstaller-hooks-contrib": HOOKS_CONTRIB_VERSION}
    missing = []
    for name, version in wanted.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != version:
            missing.append(f"{name}=={version}")
    if not missing:
        return
    print(f"== installing {' '.join(missing)} into {sys.prefix}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)


def build(dist: Path = DEFAULT_DIST, work: Path = DEFAULT_WORK, *, reuse: bool = False,
          clean: bool = False, quiet: bool = False) -> Path:
    """Build the bundle (or reuse an up-to-date one); returns the executable's path."""
    dist, work = Path(dist).absolute(), Path(work).absolute()
    digest = inputs_digest()
    exe = executable_path(dist)
    if reuse and is_up_to_date(dist, digest):
        print(f"== bundle up to date ({digest[:12]}): {exe.parent}", flush=True)
        return exe
    ensure_pyinstaller()
    if not (ROOT / "studio" / "app.py").is_file():
        print("warning: studio/app.py does not exist yet: the bundle can run --self-test "
              "(headless) but cannot open the window", file=sys.stderr, flush=True)
    stamp = dist / STAMP_NAME
    stamp.unlink(missing_ok=True)
    command = [sys.executable, "-m", "PyInstaller", "--noconfirm",
               "--distpath", str(dist), "--workpath", str(work),
               "--log-level", "WARN" if quiet else "INFO"]
    if clean:
        command.append("--clean")
    command.append(str(SPEC))
    print("== " + " ".join(command), flush=True)
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=ROOT)
    seconds = time.monotonic() - started
    if not exe.is_file():
        raise SystemExit(f"PyInstaller finished but {exe} is missing")
    stamp.write_text(digest + "\n")
    size = bundle_size(exe.parent)
    print(f"== built {exe.parent} in {seconds:.0f} s: {size / 2**20:.0f} MiB", flush=True)
    return exe


def _reexec_in_checkout_venv() -> None:
    """Started by a Python outside any venv: use the checkout's .venv when it has one."""
    venv_python = ROOT / ".venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if sys.prefix == sys.base_prefix and venv_python.is_file():
        os.execv(str(venv_python), [str(venv_python), __file__, *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the one-folder GGUF Studio app.")
    parser.add_argument("--dist", type=Path, default=DEFAULT_DIST, help=f"output dir (default {DEFAULT_DIST})")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"work dir (default {DEFAULT_WORK})")
    parser.add_argument("--reuse", action="store_true", help="skip the build when the inputs are unchanged")
    parser.add_argument("--clean", action="store_true", help="drop PyInstaller's caches first")
    parser.add_argument("--quiet", action="store_true", help="PyInstaller warnings only")
    args = parser.parse_args(argv)
    if args.clean and args.work.exists():
        shutil.rmtree(args.work)
    exe = build(args.dist, args.work, reuse=args.reuse, clean=args.clean, quiet=args.quiet)
    print(exe)
    return 0


if __name__ == "__main__":
    _reexec_in_checkout_venv()
    sys.exit(main())
