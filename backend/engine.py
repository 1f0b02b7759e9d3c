"""Finding or building the `llama-server` binary.

Resolution order: an explicit path (setting or `--llama-server`), the environment
variable GGUF_STUDIO_LLAMA_SERVER, the managed engine in the user data dir, `PATH`.

The managed engine is compiled here from the llama.cpp sources vendored in the pinned
llama-cpp-python source distribution, which pip fetches from the package registry and
whose hash we check.  No prebuilt binary is ever downloaded.  Builds are keyed by
version and CMake flags and installed atomically: a directory appears under its final
name only once it holds a working binary.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import platformdirs

from backend.errors import BuildToolMissing, EngineBuildFailed, EngineNotFound

# The one place the engine's version is pinned.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

ENV_LLAMA_SERVER = "GGUF_STUDIO_LLAMA_SERVER"
ENV_DATA_DIR = "GGUF_STUDIO_DATA_DIR"
BINARY_NAME = "llama-server.exe" if os.name == "nt" else "llama-server"

BASE_CMAKE_ARGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


@dataclass(frozen=True)
class BuildProgress:
    """One step of a build, for the command line and the window alike."""

    phase: str  # "fetch", "configure", "compile", "install", "done"
    percent: float  # 0..100 over the whole build
    line: str = ""


ProgressCallback = Callable[[BuildProgress], None]


@dataclass(frozen=True)
class Candidate:
    source: str  # "explicit", "environment", "managed", "PATH"
    path: Path | None
    usable: bool
    reason: str  # why it is used, or why not


@dataclass(frozen=True)
class Resolution:
    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.usable), None)

    @property
    def path(self) -> Path:
        chosen = self.chosen
        if chosen is None or chosen.path is None:
            raise EngineNotFound(
                "No llama-server found. Build the managed engine with "
                "`gguf-studio engine build`, or point GGUF Studio at a binary with "
                f"--llama-server PATH or {ENV_LLAMA_SERVER}."
            )
        return chosen.path

    def describe(self) -> list[str]:
        chosen = self.chosen
        lines = []
        for c in self.candidates:
            mark = "->" if c is chosen else "  "
            where = f" {c.path}" if c.path else ""
            lines.append(f"{mark} {c.source}:{where} ({c.reason})")
        return lines


@dataclass(frozen=True)
class BuildKey:
    version: str = LLAMA_CPP_PYTHON_VERSION
    extra_cmake_args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        digest = hashlib.sha256(
            json.dumps([self.version, *BASE_CMAKE_ARGS, *self.extra_cmake_args]).encode()
        ).hexdigest()[:12]
        return f"llama.cpp-{self.version}-{digest}"


@dataclass
class Engine:
    """Where engines live for one user, and how to find or build one."""

    data_dir: Path = field(default_factory=lambda: default_data_dir())
    # Sources and build trees; shareable between data dirs (the tests do).
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self.cache_dir = Path(self.cache_dir) if self.cache_dir else self.data_dir / "cache"

    @property
    def engines_dir(self) -> Path:
        return self.data_dir / "engines"

    def managed_binary(self, key: BuildKey = BuildKey()) -> Path:
        return self.engines_dir / key.name / BINARY_NAME

    def installed(self, key: BuildKey = BuildKey()) -> bool:
        return _is_executable(self.managed_binary(key))

    def resolve(self, explicit: str | os.PathLike | None = None,
                environ: Mapping[str, str] | None = None,
                key: BuildKey = BuildKey()) -> Resolution:
        environ = os.environ if environ is None else environ
        candidates = [
            _candidate("explicit", explicit, "given with --llama-server or the setting"),
            _candidate("environment", environ.get(ENV_LLAMA_SERVER) or None, f"from {ENV_LLAMA_SERVER}"),
        ]
        managed = self.managed_binary(key)
        candidates.append(Candidate(
            "managed", managed, _is_executable(managed),
            "built by GGUF Studio" if _is_executable(managed)
            else "not built yet (gguf-studio engine build)",
        ))
        on_path = shutil.which(BINARY_NAME, path=environ.get("PATH"))
        candidates.append(Candidate(
            "PATH", Path(on_path) if on_path else None, on_path is not None,
            "found on PATH" if on_path else "none on PATH",
        ))
        # Only the first usable one is used; say so for the ones after it.
        seen_usable = False
        final = []
        for c in candidates:
            if c.usable and seen_usable:
                c = Candidate(c.source, c.path, True, c.reason + "; not used, an earlier one wins")
            seen_usable = seen_usable or c.usable
            final.append(c)
        return Resolution(tuple(final))

    def source_tree(self, progress: ProgressCallback | None = None) -> Path:
        """The vendored llama.cpp tree of the pinned sdist, fetched and unpacked once."""
        return asyncio.run(self.source_tree_async(progress))

    async def source_tree_async(self, progress: ProgressCallback | None = None) -> Path:
        report = progress or (lambda _p: None)
        src_root = self.cache_dir / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
        tree = src_root / "vendor" / "llama.cpp"
        if (tree / "CMakeLists.txt").is_file():
            return tree
        sdist = await self._fetch_sdist(report)
        report(BuildProgress("fetch", 4, "unpacking sources"))
        src_root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=src_root.parent, prefix=".unpack-"))
        try:
            await asyncio.to_thread(_extract, sdist, tmp)
            unpacked = next(tmp.iterdir())
            os.replace(unpacked, src_root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return tree

    async def build(self, extra_cmake_args: Sequence[str] = (),
                    progress: ProgressCallback | None = None,
                    jobs: int | None = None) -> Path:
        """Build and install the managed engine; a no-op when this key is installed."""
        key = BuildKey(extra_cmake_args=tuple(extra_cmake_args))
        report = progress or (lambda _p: None)
        target = self.managed_binary(key)
        if _is_executable(target):
            report(BuildProgress("done", 100, f"already built: {key.name}"))
            return target
        tools = find_build_tools()
        tree = await self.source_tree_async(report)
        build_dir = self.cache_dir / "build" / key.name
        log_path = self.cache_dir / "build" / f"{key.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CC=tools.cc, CXX=tools.cxx)
        with log_path.open("w") as log:
            report(BuildProgress("configure", 5, "configuring with CMake"))
            await _run_logged(
                [tools.cmake, "-S", str(tree), "-B", str(build_dir), "-G", "Ninja",
                 f"-DCMAKE_MAKE_PROGRAM={tools.ninja}", *BASE_CMAKE_ARGS, *key.extra_cmake_args],
                log, env, lambda line: report(BuildProgress("configure", 5, line)),
                failure="Configuring llama.cpp failed", log_path=log_path,
            )
            jobs = jobs or os.cpu_count() or 2
            report(BuildProgress("compile", 8, f"compiling llama-server with {jobs} jobs"))

            def on_compile_line(line: str) -> None:
                m = _NINJA_PROGRESS.match(line)
                if m:
                    done, total = int(m.group(1)), int(m.group(2))
                    report(BuildProgress("compile", 8 + 90 * done / max(total, 1), line))

            await _run_logged(
                [tools.cmake, "--build", str(build_dir), "--target", "llama-server",
                 "-j", str(jobs)],
                log, env, on_compile_line, failure="Compiling llama-server failed",
                log_path=log_path,
            )
        built = build_dir / "bin" / BINARY_NAME
        if not _is_executable(built):
            raise EngineBuildFailed(f"The build finished but produced no {BINARY_NAME}.",
                                    _tail(log_path))
        report(BuildProgress("install", 99, f"installing {key.name}"))
        self._install(key, built)
        report(BuildProgress("done", 100, f"built {key.name}"))
        return target

    def _install(self, key: BuildKey, built: Path) -> None:
        self.engines_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=self.engines_dir, prefix=".staging-"))
        try:
            shutil.copy2(built, staging / BINARY_NAME)
            (staging / "engine.json").write_text(json.dumps({
                "llama_cpp_python": key.version,
                "cmake_args": [*BASE_CMAKE_ARGS, *key.extra_cmake_args],
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }, indent=2))
            final = self.engines_dir / key.name
            if final.exists():  # a leftover without a binary; never a working engine
                shutil.rmtree(final)
            os.replace(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def _fetch_sdist(self, report: ProgressCallback) -> Path:
        sdist_dir = self.cache_dir / "sdist"
        sdist_dir.mkdir(parents=True, exist_ok=True)
        name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        path = sdist_dir / name
        if not (path.is_file() and _sha256(path) == LLAMA_CPP_PYTHON_SDIST_SHA256):
            report(BuildProgress("fetch", 1, f"fetching llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sources"))
            tmp = Path(tempfile.mkdtemp(dir=sdist_dir, prefix=".fetch-"))
            try:
                with (tmp / "pip.log").open("w") as log:
                    await _run_logged(
                        [sys.executable, "-m", "pip", "download", "--no-deps",
                         "--no-binary", ":all:",
                         f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(tmp)],
                        log, dict(os.environ), lambda line: None,
                        failure="Fetching the llama.cpp sources from the package registry failed",
                        log_path=tmp / "pip.log",
                    )
                fetched = tmp / name
                if not fetched.is_file():
                    raise EngineBuildFailed("The package registry did not return the llama.cpp sources.")
                digest = _sha256(fetched)
                if digest != LLAMA_CPP_PYTHON_SDIST_SHA256:
                    raise EngineBuildFailed(
                        f"The llama.cpp sources failed their hash check (got {digest[:16]}…); "
                        "refusing to build them.")
                os.replace(fetched, path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return path


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


def default_data_dir() -> Path:
    override = os.environ.get(ENV_DATA_DIR)
    return Path(override) if override else Path(platformdirs.user_data_dir("gguf-studio"))


# --- helpers --------------------------------------------------------------------------

_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def _candidate(source: str, value: str | os.PathLike | None, origin: str) -> Candidate:
    if not value:
        return Candidate(source, None, False, "not set")
    path = Path(value).expanduser()
    if _is_executable(path):
        return Candidate(source, path, True, origin)
    why = "not an executable file" if path.exists() else "does not exist"
    return Candidate(source, path, False, f"{origin}, but {why}")


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _extract(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")


def _tail(log_path: Path, lines: int = 30) -> str:
    try:
        with log_path.open(errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return ""


async def _run_logged(cmd: Sequence[str], log, env: Mapping[str, str],
                      on_line: Callable[[str], None], *, failure: str, log_path: Path) -> None:
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL, env=dict(env))
    except OSError as exc:
        raise EngineBuildFailed(f"{failure}: {exc.strerror or exc}") from None
    try:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            log.write(line + "\n")
            on_line(line)
        code = await proc.wait()
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        await proc.communicate()  # reap it and close its pipe
        raise
    finally:
        log.flush()
    if code != 0:
        raise EngineBuildFailed(f"{failure} (exit {code}); the full log is {log_path}.",
                                _tail(log_path))
