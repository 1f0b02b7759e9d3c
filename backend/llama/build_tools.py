"""The tools a build runs: the C and C++ compilers, CMake and Ninja, found on this machine
(`find_build_tools`, preferring the cmake and ninja installed beside Python), and one step
of a build run with its output logged whole and shown line by line (`run_logged`; the
log's last lines for an error, `build_log_tail`).  What to build and where it is installed
is the engine's (`backend.llama.engine`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence, TextIO

from backend.errors import BuildToolMissing, EngineBuildFailed
from backend.llama.child_process import end_process_group, spawn
from backend.llama.log import for_display, read_lines

__all__ = ["BuildTools", "build_log_tail", "find_build_tools", "run_logged"]


@dataclass(frozen=True)
class BuildTools:
    cc: str
    cxx: str
    cmake: str
    ninja: str


def find_build_tools(environ: Mapping[str, str] | None = None) -> BuildTools:
    """The compiler and build tools, preferring the cmake/ninja installed beside Python."""
    environ = os.environ if environ is None else environ
    path = environ.get("PATH", "")
    venv_bin = str(Path(sys.executable).parent)
    search = os.pathsep.join([venv_bin, path])

    def need(names: Sequence[str], what: str, hint: str) -> str:
        for name in names:
            found = shutil.which(name, path=search)
            if found:
                return found
        raise BuildToolMissing(f"No {what} found ({', '.join(names)}). {hint}")

    compiler_hint = ("Install a C/C++ compiler (Debian/Ubuntu: `apt install build-essential`; "
                     "macOS: `xcode-select --install`; Windows: Visual Studio Build Tools).")
    cc = need([environ["CC"]] if environ.get("CC") else ["cc", "gcc", "clang"], "C compiler", compiler_hint)
    cxx = need([environ["CXX"]] if environ.get("CXX") else ["c++", "g++", "clang++"], "C++ compiler", compiler_hint)
    cmake = need(["cmake"], "CMake", "Install it with `pip install cmake`.")
    ninja = need(["ninja"], "Ninja", "Install it with `pip install ninja`.")
    return BuildTools(cc, cxx, cmake, ninja)


async def run_logged(cmd: Sequence[str], log: TextIO, env: Mapping[str, str],
                      on_line: Callable[[str], None], *, failure: str, log_path: Path) -> None:
    try:
        proc = await spawn(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                           stdin=asyncio.subprocess.DEVNULL, env=dict(env))
    except OSError as exc:
        raise EngineBuildFailed(f"{failure}: {exc.strerror or exc}") from None
    try:
        assert proc.stdout is not None
        async for line in read_lines(proc.stdout):  # compilers write lines of any length
            line = line.rstrip()
            log.write(line + "\n")
            on_line(for_display(line))
        code = await proc.wait()
    except BaseException:
        await end_process_group(proc)
        raise
    finally:
        log.flush()
    if code != 0:
        raise EngineBuildFailed(f"{failure} (exit {code}); the full log is {log_path}.",
                                build_log_tail(log_path))


def build_log_tail(log_path: Path, lines: int = 30) -> str:
    try:
        with log_path.open(errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return ""
