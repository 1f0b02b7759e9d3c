"""Finding or building the `llama-server` binary.

Resolution order: an explicit path (setting or `--llama-server`), the environment
variable GGUF_STUDIO_LLAMA_SERVER, the managed engine in the user data dir, `PATH`.

The managed engine is compiled here from the llama.cpp sources vendored in the pinned
llama-cpp-python source distribution, fetched from the package index pip is configured
with and checked against its pinned size and SHA-256 before anything reads it
(backend/llama/sources.py says why not with pip).  No prebuilt binary is ever
downloaded.  Builds are keyed by
version and CMake flags and installed atomically: a directory appears under its final
name only once it holds a working binary.

Every engine built now has llama.cpp's RPC backend: its llama-server takes `--rpc` and
its directory holds `ggml-rpc-server` (run by `gguf-studio rpc-worker`), both from the
same sources, so a worker always speaks the engine's RPC protocol version.  An engine
built before that (same flags but no RPC) stays found and used for every load without RPC
workers, so nobody has to rebuild for a feature they do not use; a load with workers on
such an engine says to rebuild.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import re
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import platformdirs

from backend.llama.accelerators import BACKENDS, Accelerators, detect
from backend.llama.build_tools import build_log_tail, find_build_tools, run_logged
from backend.llama.patches import LLAMA_CPP_PATCHES, LlamaPatch, patched_tree
from backend.llama.rpc_worker import RpcProtocol, protocol_of_sources
from backend.llama.sources import PinnedFile, fetch_pinned
from backend.llama.environment import engine_environment
from backend.errors import BuildToolMissing, EngineBuildFailed, EngineNotFound

# The one place the engine's version is pinned.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_PYTHON_SDIST_SIZE = 76_589_250

ENV_LLAMA_SERVER = "GGUF_STUDIO_LLAMA_SERVER"
ENV_DATA_DIR = "GGUF_STUDIO_DATA_DIR"
BINARY_NAME = "llama-server.exe" if os.name == "nt" else "llama-server"
# llama.cpp's own name for its RPC server (tools/rpc), installed beside llama-server.
RPC_SERVER_NAME = "ggml-rpc-server.exe" if os.name == "nt" else "ggml-rpc-server"

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
# Part of every engine built now; engines from before (their key without it) lack RPC.
RPC_CMAKE_ARGS: tuple[str, ...] = ("-DGGML_RPC=ON",)


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
    """What makes one engine differ from another; its name is the install directory.

    `toolkit` names the external headers/compilers a GPU build used (with versions), so
    a rebuild against other ones gets a new key.  `rpc=False` names the engines built
    before every engine had RPC (their names are what they always were), so they stay
    found.  `patches` are ours applied to the pinned sources (`backend.llama.patches`),
    each by its name and SHA-256; `()` names the engines built before them (their names
    are what they always were).
    """

    version: str = LLAMA_CPP_PYTHON_VERSION
    extra_cmake_args: tuple[str, ...] = ()
    backend: str = "cpu"
    toolkit: tuple[str, ...] = ()
    rpc: bool = True
    patches: tuple[LlamaPatch, ...] = LLAMA_CPP_PATCHES

    @property
    def cmake_args(self) -> tuple[str, ...]:
        return (*BASE_CMAKE_ARGS, *(RPC_CMAKE_ARGS if self.rpc else ()), *self.extra_cmake_args)

    @property
    def name(self) -> str:
        parts = [self.version, *self.cmake_args, *self.toolkit, *(p.key for p in self.patches)]
        digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]
        if self.backend == "cpu":
            return f"llama.cpp-{self.version}-{digest}"
        return f"llama.cpp-{self.version}-{self.backend}-{digest}"


@dataclass(init=False)
class Engine:
    """Where engines live for one user, and how to find or build one."""

    data_dir: Path
    # Sources and build trees; shareable between data dirs (the tests do).
    cache_dir: Path

    def __init__(self, data_dir: Path | None = None, cache_dir: Path | None = None, *,
                 patches: tuple[LlamaPatch, ...] = LLAMA_CPP_PATCHES) -> None:
        """`patches`: what this engine's builds apply to the pinned sources (the tests
        that build stand-in sources apply none)."""
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.cache_dir = Path(cache_dir) if cache_dir else self.data_dir / "cache"
        self.patches = patches

    @property
    def engines_dir(self) -> Path:
        return self.data_dir / "engines"

    def managed_binary(self, key: BuildKey | None = None) -> Path:
        return self.engines_dir / (key or BuildKey(patches=self.patches)).name / BINARY_NAME

    def installed(self, key: BuildKey | None = None) -> bool:
        return _is_executable(self.managed_binary(key))

    def managed_binary_for(self, backend: str) -> Path | None:
        """The installed engine of `backend` for the pinned version, if any: one with our
        patches before one from before them, one with RPC before one from before RPC,
        then the newest."""
        if backend == "cpu":
            flags = backend_cmake_args("cpu")
            keys = (BuildKey(extra_cmake_args=flags, patches=self.patches),
                    BuildKey(extra_cmake_args=flags, patches=()),
                    BuildKey(extra_cmake_args=flags, rpc=False, patches=()))
            return next((b for b in map(self.managed_binary, keys) if _is_executable(b)),
                        self.managed_binary(keys[0]))
        found = [d / BINARY_NAME for d in self.engines_dir.glob(
                     f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{backend}-*")
                 if _is_executable(d / BINARY_NAME)]
        return max(found, key=lambda p: (has_rpc(p), engine_patches(p) == _names(self.patches),
                                         p.stat().st_mtime)) if found else None

    def installed_backends(self) -> dict[str, Path]:
        out = {}
        for backend in BACKENDS:
            binary = self.managed_binary_for(backend)
            if binary is not None and _is_executable(binary):
                out[backend] = binary
        return out

    def _built_reason(self, binary: Path | None) -> str:
        """Why a managed engine is used, and what it lacks that a build would add."""
        if not has_rpc(binary):
            return _WITHOUT_RPC
        if engine_patches(binary) != _names(self.patches):
            return _WITHOUT_PATCHES
        return "built by GGUF Studio"

    def rpc_server(self, explicit: str | os.PathLike[str] | None = None,
                   backends: Sequence[str] | None = None) -> Path:
        """The RPC server a worker runs: `explicit`, else the one of the best managed
        engine here (`backends` in order, default: this machine's best first) built
        with RPC."""
        if explicit:
            path = Path(explicit).expanduser()
            if not _is_executable(path):
                raise EngineNotFound(f"The RPC server {path} is not an executable file.")
            return path
        for backend in (list(backends) if backends is not None else machine_backends()):
            found = rpc_server_beside(self.managed_binary_for(backend))
            if found is not None:
                return found
        raise EngineNotFound(
            "No RPC server here: the engine on this machine was built before GGUF Studio's "
            "engines had RPC, or not at all. `gguf-studio engine build` builds one with it.")

    def resolve(self, explicit: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None,
                key: BuildKey | None = None,
                backends: Sequence[str] | None = None) -> Resolution:
        """Which llama-server to run.  Managed engines are tried for `backends` in order
        (default: the accelerated ones this machine can run, best first, then the CPU)."""
        environ = os.environ if environ is None else environ
        candidates = [
            _candidate("explicit", explicit, "given with --llama-server or the setting"),
            _candidate("environment", environ.get(ENV_LLAMA_SERVER) or None, f"from {ENV_LLAMA_SERVER}"),
        ]
        managed: list[tuple[str, Path | None]]
        if key is not None:
            managed = [(key.backend, self.managed_binary(key))]
        else:
            wanted = list(backends) if backends is not None else machine_backends()
            managed = [(b, self.managed_binary_for(b)) for b in wanted]
        for backend, binary in managed:
            label = "managed" if backend == "cpu" else f"managed {backend}"
            built = binary is not None and _is_executable(binary)
            candidates.append(Candidate(
                label, binary if built else (binary or None), built,
                self._built_reason(binary) if built
                else f"not built yet (gguf-studio engine build --backend {backend})",
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
                    jobs: int | None = None, backend: str = "cpu") -> Path:
        """Build and install the managed engine for `backend`; a no-op when its key is
        installed."""
        report = progress or (lambda _p: None)
        plan = await plan_build(backend, self.cache_dir, extra_cmake_args,
                                lambda line: report(BuildProgress("fetch", 2, line)),
                                patches=self.patches)
        key = plan.key
        target = self.managed_binary(key)
        if _is_executable(target):
            report(BuildProgress("done", 100, f"already built: {key.name}"))
            return target
        tools = find_build_tools()
        tree = await self.source_tree_async(report)
        if key.patches:
            report(BuildProgress("fetch", 4, "applying " + ", ".join(p.name for p in key.patches)))
            tree = await asyncio.to_thread(patched_tree, tree, key.patches)
        build_dir = self.cache_dir / "build" / key.name
        log_path = self.cache_dir / "build" / f"{key.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = engine_environment() | {"CC": tools.cc, "CXX": tools.cxx}
        with log_path.open("w") as log:
            report(BuildProgress("configure", 5, "configuring with CMake"))
            await run_logged(
                [tools.cmake, "-S", str(tree), "-B", str(build_dir), "-G", "Ninja",
                 f"-DCMAKE_MAKE_PROGRAM={tools.ninja}", *key.cmake_args,
                 *plan.machine_args],
                log, env, lambda line: report(BuildProgress("configure", 5, line)),
                failure="Configuring llama.cpp failed", log_path=log_path,
            )
            jobs = jobs or os.cpu_count() or 2
            report(BuildProgress("compile", 8, f"compiling llama-server and its RPC server "
                                                f"with {jobs} jobs"))

            def on_compile_line(line: str) -> None:
                m = _NINJA_PROGRESS.match(line)
                if m:
                    done, total = int(m.group(1)), int(m.group(2))
                    report(BuildProgress("compile", 8 + 90 * done / max(total, 1), line))

            await run_logged(
                [tools.cmake, "--build", str(build_dir), "--target", *_BUILD_TARGETS,
                 "-j", str(jobs)],
                log, env, on_compile_line, failure="Compiling llama-server failed",
                log_path=log_path,
            )
        built = [build_dir / "bin" / name for name in (BINARY_NAME, RPC_SERVER_NAME)]
        for binary in built:
            if not _is_executable(binary):
                raise EngineBuildFailed(f"The build finished but produced no {binary.name}.",
                                        build_log_tail(log_path))
        report(BuildProgress("install", 99, f"installing {key.name}"))
        self._install(key, built, protocol_of_sources(tree))
        report(BuildProgress("done", 100, f"built {key.name}"))
        return target

    def _install(self, key: BuildKey, built: Sequence[Path],
                 rpc_protocol: RpcProtocol | None = None) -> None:
        """Every binary of the build appears at once: the directory is filled aside and
        renamed into place."""
        self.engines_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=self.engines_dir, prefix=".staging-"))
        try:
            for binary in built:
                shutil.copy2(binary, staging / binary.name)
            (staging / "engine.json").write_text(json.dumps({
                "llama_cpp_python": key.version,
                "backend": key.backend,
                "toolkit": list(key.toolkit),
                "rpc": key.rpc,
                # Ours, applied to the pinned sources (backend.llama.patches).
                "patches": list(_names(key.patches)),
                # What its workers must speak (backend.llama.rpc_worker.check_rpc_workers).
                "rpc_protocol": [rpc_protocol.major, rpc_protocol.minor, rpc_protocol.patch]
                if rpc_protocol else None,
                "cmake_args": list(key.cmake_args),
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
        pinned = PinnedFile("llama-cpp-python", f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz",
                            LLAMA_CPP_PYTHON_SDIST_SHA256, LLAMA_CPP_PYTHON_SDIST_SIZE,
                            "the llama.cpp sources")
        path = sdist_dir / pinned.filename
        if not (path.is_file() and _sha256(path) == pinned.sha256):
            fetching = f"fetching llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sources"
            report(BuildProgress("fetch", 1, fetching))
            shown = 0

            def on_bytes(received: int) -> None:
                nonlocal shown
                if received - shown >= pinned.size // 100 or received == pinned.size:
                    shown = received
                    report(BuildProgress("fetch", 1 + 3 * received / pinned.size,
                                         f"{fetching}: {received >> 20} of {pinned.size >> 20} MiB"))

            tmp = Path(tempfile.mkdtemp(dir=sdist_dir, prefix=".fetch-"))
            try:
                await fetch_pinned(pinned, tmp / pinned.filename, on_bytes)
                os.replace(tmp / pinned.filename, path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return path


@dataclass(frozen=True)
class BuildPlan:
    key: BuildKey
    machine_args: tuple[str, ...] = ()  # paths on this machine; not part of the key


async def plan_build(backend: str, cache_dir: Path, extra_cmake_args: Sequence[str] = (),
                     report: Callable[[str], None] = lambda line: None,
                     accelerators: "Accelerators | None" = None,
                     patches: tuple[LlamaPatch, ...] = LLAMA_CPP_PATCHES) -> BuildPlan:
    """The key and CMake arguments of a `backend` engine (with `patches` applied to its
    sources); fetches Vulkan headers when the system's are too old.  Raises
    BuildToolMissing (with the install line) when this machine lacks the backend's
    toolkit."""
    if backend not in BACKENDS:
        raise BuildToolMissing(f"Unknown engine backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    flags = (*backend_cmake_args(backend), *extra_cmake_args)
    if backend == "cpu":
        return BuildPlan(BuildKey(extra_cmake_args=tuple(flags), patches=patches))
    status = (accelerators or detect_accelerators()).get(backend)
    if not status.toolkit.present:
        hint = f" Install: {status.toolkit.install}" if status.toolkit.install else ""
        raise BuildToolMissing(f"Cannot build the {backend} engine here: {status.toolkit.reason}.{hint}")
    if backend == "vulkan":
        from backend.llama.vulkan_headers import ensure_vulkan_headers

        headers = await ensure_vulkan_headers(cache_dir, report)
        if headers.fetched:
            return BuildPlan(BuildKey(extra_cmake_args=flags, backend=backend,
                                      toolkit=(headers.package,), patches=patches),
                             (f"-DVulkan_INCLUDE_DIR={headers.include_dir}",))
        return BuildPlan(BuildKey(extra_cmake_args=flags, backend=backend,
                                  toolkit=(f"vulkan-headers={headers.version}",), patches=patches))
    return BuildPlan(BuildKey(extra_cmake_args=flags, backend=backend,
                              toolkit=status.toolkit.identity, patches=patches),
                     status.toolkit.cmake_args)


def backend_cmake_args(backend: str, system: str | None = None) -> tuple[str, ...]:
    """The llama.cpp switches of one backend.  llama.cpp turns Metal on by itself on
    macOS, so the CPU engine there says no to it."""
    system = system or platform.system()
    if backend == "cpu":
        return ("-DGGML_METAL=OFF",) if system == "Darwin" else ()
    return {"cuda": ("-DGGML_CUDA=ON",), "vulkan": ("-DGGML_VULKAN=ON",),
            "metal": ("-DGGML_METAL=ON",), "hip": ("-DGGML_HIP=ON",)}[backend]


_DETECTED: "Accelerators | None" = None


def detect_accelerators(refresh: bool = False) -> "Accelerators":
    """This machine's accelerators, looked at once per process (it runs vulkaninfo)."""
    global _DETECTED
    if _DETECTED is None or refresh:
        _DETECTED = detect()
    return _DETECTED


def machine_backends() -> list[str]:
    """Engine backends worth running here, best first; ends with the CPU."""
    return detect_accelerators().wanted()


def detected_backends() -> list[str] | None:
    """`machine_backends()` if this process has looked already, else None (never blocks)."""
    return _DETECTED.wanted() if _DETECTED is not None else None


def rpc_server_beside(llama_server: Path | None) -> Path | None:
    """The RPC server built with this llama-server (in the same engine directory), if any."""
    if llama_server is None:
        return None
    candidate = llama_server.parent / RPC_SERVER_NAME
    return candidate if _is_executable(candidate) else None


def engine_patches(llama_server: Path | None) -> tuple[str, ...]:
    """The names of our patches a managed engine was built with (its `engine.json`); ()
    for one built before them and for a binary GGUF Studio did not build."""
    if llama_server is None:
        return ()
    try:
        record = json.loads((llama_server.parent / "engine.json").read_text())
    except (OSError, ValueError):
        return ()
    names = record.get("patches") if isinstance(record, dict) else None
    return tuple(n for n in names if isinstance(n, str)) if isinstance(names, list) else ()


def has_rpc(llama_server: Path | None) -> bool:
    """Whether a managed engine was built with RPC (its RPC server lies beside it).  Says
    nothing of a binary GGUF Studio did not build: that one's output tells at load."""
    return rpc_server_beside(llama_server) is not None


def default_data_dir() -> Path:
    override = os.environ.get(ENV_DATA_DIR)
    return Path(override) if override else Path(platformdirs.user_data_dir("gguf-studio"))


# --- helpers --------------------------------------------------------------------------

_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
_BUILD_TARGETS = ("llama-server", "ggml-rpc-server")
_WITHOUT_RPC = ("built by GGUF Studio before engines had RPC: fine without RPC workers; "
                "`gguf-studio engine build` builds one with it")
_WITHOUT_PATCHES = ("built by GGUF Studio before its engine patches: parked prompts of "
                    "sliding-window and hybrid models are computed again after a restore; "
                    "`gguf-studio engine build` builds one with them")


def _names(patches: tuple[LlamaPatch, ...]) -> tuple[str, ...]:
    return tuple(p.name for p in patches)


def _candidate(source: str, value: str | os.PathLike[str] | None, origin: str) -> Candidate:
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
