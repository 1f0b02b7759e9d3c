"""The real clients people point at the port, run end to end against a real service.

A `StudioService` with the real llama-server and a tiny model (random weights: it never
stops by itself, so the port's output cap keeps every answer short) serves the port on
127.0.0.1; Codex CLI, OpenCode and Claude Code, installed at pinned versions by
`scripts/install-clients`, run non-interactively against it in throwaway home and config
dirs, offline (no login, no telemetry, no update checks, no plugin installs), each under
a hard timeout.  Claude Code's prompt (about 4k tokens) is read by SmolLM2, a trained
model whose answers end by themselves (`start_smol_studio`).  The tests skip, saying why, when Node.js/npm are missing or the install
failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, cast

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend.app.service import StudioService
from backend.app.sharing.snippets import ClientTarget, Snippet
from backend.settings import Settings
from backend.llama.load import LoadSettings, LoadSpec
from tests.model_factory import write_tiny_model

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "scripts" / "install-clients"

API_KEY = "gguf-studio-clients-test-key"
KEY_ENV = "GGUF_STUDIO_TEST_API_KEY"  # the variable the clients read the key from
MODEL_ID = "tiny"
OUTPUT_CAP = 16  # tokens: the random model never stops by itself
CONTEXT = 32768  # room for Codex's ~5k-token prompt and a long "blocker" generation
KEEPALIVE = 0.3  # seconds between keep-alives while queued
ENGINE_THREADS = 1
CLIENT_TIMEOUT = 120.0  # seconds any one client run may take; it is killed after that
INSTALL_TIMEOUT = 480.0  # seconds for scripts/install-clients (a fresh install: about 30 s)


# --- the clients ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Clients:
    codex_bin: Path
    opencode_bin: Path
    opencode_plugin_dir: Path
    codex_version: str
    opencode_version: str
    claude_bin: Path
    claude_version: str


@pytest.fixture(scope="session")
def clients() -> Clients:
    """Codex CLI, OpenCode and Claude Code at their pinned versions (installed on first use)."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.skip("real-client tests need Node.js and npm to install Codex CLI, OpenCode and "
                    f"Claude Code from the npm registry; not on PATH: {', '.join(missing)}")
    # In its own process group, so that a timeout also ends the npm it is running.
    install = subprocess.Popen([str(INSTALL_SCRIPT)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = install.communicate(timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(install.pid, signal.SIGKILL)
        install.communicate()
        pytest.skip(f"scripts/install-clients did not finish within {INSTALL_TIMEOUT:g}s "
                    "(is the npm registry reachable?), so the real-client tests cannot run")
    if install.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        pytest.skip(f"scripts/install-clients failed (exit {install.returncode}), so the "
                    f"real-client tests cannot run:\n{tail}")
    values = dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)
    return Clients(codex_bin=Path(values["CODEX_BIN"]), opencode_bin=Path(values["OPENCODE_BIN"]),
                   opencode_plugin_dir=Path(values["OPENCODE_PLUGIN_DIR"]),
                   codex_version=values["CODEX_VERSION"],
                   opencode_version=values["OPENCODE_VERSION"],
                   claude_bin=Path(values["CLAUDE_BIN"]), claude_version=values["CLAUDE_VERSION"])


# --- the service ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory: pytest.TempPathFactory, vocab_path: Path) -> Path:
    """The tiny test model, trained context 32k so one slot holds Codex's prompt and more."""
    return write_tiny_model(tmp_path_factory.mktemp("client-models") / f"{MODEL_ID}.gguf",
                            vocab_path, context_length=CONTEXT)


StartStudio = Callable[..., Awaitable[StudioService]]


@pytest.fixture
async def start_studio(tmp_path: Path, llama_server_binary: Path,
                       long_context_model: Path) -> AsyncIterator[StartStudio]:
    """`await start_studio(parallel=1, max_queue=0)`: a loaded service on 127.0.0.1:<free>."""
    services: list[StudioService] = []

    async def start(*, parallel: int = 1, max_queue: int = 0) -> StudioService:
        settings = Settings(host="127.0.0.1", port=0, api_key=API_KEY,
                            llama_server=str(llama_server_binary),
                            max_output_tokens=OUTPUT_CAP, keepalive_interval=KEEPALIVE,
                            max_queue=max_queue, reload_grace=2, load_timeout=60)
        service = StudioService(settings, log_dir=tmp_path / "logs")
        services.append(service)
        await service.start_gateway()
        # One engine thread: a test holding a slot with a long generation must leave CPU
        # to the port and the client (on 2 cores, two busy engine threads stalled the
        # test's loop, and so the port's keep-alives, for seconds).
        await service.load(LoadSettings(parallel=str(parallel), ctx_size=CONTEXT * parallel, threads=ENGINE_THREADS).to_spec(str(long_context_model), model_id=MODEL_ID))
        return service

    yield start
    for service in services:
        await service.close()


#: SmolLM2's model id at the port, and its context (its trained one: one slot holds Claude
#: Code's ~4k-token prompt and a few turns).
SMOL_ID = "smol"
SMOL_CONTEXT = 8192


@pytest.fixture
async def start_smol_studio(tmp_path: Path, llama_server_binary: Path,
                            smollm2_model: Path) -> AsyncIterator[StartStudio]:
    """`await start_smol_studio(parallel=1, max_queue=0)`: a service on 127.0.0.1:<free>
    serving SmolLM2 as `SMOL_ID`, with no output cap (its answers end by themselves).

    It samples greedily (`--temp 0`; Claude Code sends no temperature): on Claude Code's
    prompt a sampled SmolLM2 often rambles to the output limit (and Claude Code then asks
    it to go on, three times, and fails the turn), where a greedy one answers in a short
    sentence."""
    services: list[StudioService] = []

    async def start(*, parallel: int = 1, max_queue: int = 0) -> StudioService:
        settings = Settings(host="127.0.0.1", port=0, api_key=API_KEY,
                            llama_server=str(llama_server_binary), max_output_tokens=0,
                            keepalive_interval=KEEPALIVE, max_queue=max_queue, reload_grace=2,
                            load_timeout=60)
        service = StudioService(settings, log_dir=tmp_path / "logs")
        services.append(service)
        await service.start_gateway()
        await service.load(LoadSettings(parallel=str(parallel), ctx_size=SMOL_CONTEXT * parallel,
                                        threads=ENGINE_THREADS, extra_args=("--temp", "0"))
                           .to_spec(str(smollm2_model), model_id=SMOL_ID))
        return service

    yield start
    for service in services:
        await service.close()


def base_url(service: StudioService) -> str:
    return f"http://127.0.0.1:{service.gateway_port}/v1"


def responses_count(service: StudioService, route: str, status: int) -> int:
    return int(service.metrics.value("gguf_studio_requests_total",
                                     {"route": route, "status": str(status)}))


def rejections(service: StudioService, reason: str) -> int:
    return service.metrics.totals()["rejections"].get(reason, 0)


async def until(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what or predicate}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def occupied(service: StudioService, *, max_tokens: int = 100_000) -> AsyncIterator[None]:
    """Holds one engine slot with a long generation until the block exits.

    The output cap is lifted for this one request (it is applied when a request arrives),
    then put back; leaving the block disconnects, which frees the slot at once.
    """
    capped = service.settings
    await service.apply_settings(capped.replace(max_output_tokens=0))
    active_before = service.registry.total_active
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Tell a long story."}],
            "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(timeout=60, headers=auth_headers()) as client:
            async with client.stream("POST", f"{base_url(service)}/chat/completions",
                                     json=body) as response:
                assert response.status_code == 200, response.status_code
                await until(lambda: service.registry.total_active > active_before, 30,
                            "the blocker to be admitted")
                await service.apply_settings(capped)
                # Hold on to the line iterator: once garbage, it would close the stream.
                lines = response.aiter_lines()
                assert isinstance(lines, AsyncGenerator)  # so it has aclose (httpx's is one)
                try:
                    async for line in lines:
                        if line.startswith("data: {"):
                            break  # the first token arrived: it is generating
                    yield
                finally:
                    await lines.aclose()
    finally:
        await service.apply_settings(capped)


@contextlib.asynccontextmanager
async def occupied_place(service: StudioService) -> AsyncIterator[asyncio.Task]:
    """Takes a waiting place with a short streamed chat request (run it with the slots
    busy); yields its task, which ends once that request has been served in full."""

    async def wait_and_read() -> list[str]:
        body = {"model": MODEL_ID, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}]}
        async with httpx.AsyncClient(timeout=120, headers=auth_headers()) as client:
            async with client.stream("POST", f"{base_url(service)}/chat/completions",
                                     json=body) as response:
                assert response.status_code == 200, response.status_code
                lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        return lines

    before = service.registry.total_waiting
    task = asyncio.create_task(wait_and_read())
    try:
        await until(lambda: service.registry.total_waiting > before, 30, "the filler to wait in line")
        yield task
    except BaseException:
        task.cancel()
        raise


def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


# --- running a client ---------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class Run:
    argv: list[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    timed_out: bool = False
    log_dir: Path | None = None  # where the client writes its own log, shown on failure
    run_dir: Path | None = None  # its home, config and work dirs (a later run may continue there)

    @property
    def text(self) -> str:
        return _ANSI.sub("", self.stdout).strip()

    def describe(self) -> str:
        state = "timed out" if self.timed_out else f"exit {self.returncode}"
        text = (f"{Path(self.argv[0]).name} {state} after {self.seconds:.1f}s\n"
                f"--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-5000:]}")
        for log in sorted(self.log_dir.glob("*.log")) if self.log_dir else []:
            text += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-5000:]
        return text


@dataclass
class Process:
    """A client running in its own process group, so a timeout kills all of it."""
    run: Run
    proc: asyncio.subprocess.Process
    timeout: float
    started: float = field(default_factory=time.monotonic)
    _result: asyncio.Task | None = None

    @classmethod
    async def start(cls, argv: list[str], *, env: dict[str, str], cwd: Path,
                    stdin: bytes | None = None, timeout: float = CLIENT_TIMEOUT) -> "Process":
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=cwd, start_new_session=True,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        self = cls(Run(argv), proc, timeout)
        self._result = asyncio.create_task(self._communicate(stdin))
        return self

    @property
    def running(self) -> bool:
        assert self._result is not None  # set by start
        return not self._result.done()

    async def _communicate(self, stdin: bytes | None) -> Run:
        try:
            out, err = await asyncio.wait_for(self.proc.communicate(stdin), self.timeout)
        except asyncio.TimeoutError:
            self.run.timed_out = True
            self._kill()
            out, err = await self.proc.communicate()
        except asyncio.CancelledError:
            self._kill()
            await self.proc.communicate()
            raise
        self.run.returncode = self.proc.returncode
        self.run.stdout = out.decode(errors="replace")
        self.run.stderr = err.decode(errors="replace")
        self.run.seconds = time.monotonic() - self.started
        return self.run

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def result(self) -> Run:
        assert self._result is not None  # set by start
        return await self._result

    async def stop(self) -> None:
        if self._result is not None and not self._result.done():
            self._result.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._result


@pytest.fixture
async def processes() -> AsyncIterator[list[Process]]:
    """Every client a test starts; any still running at the end is killed."""
    started: list[Process] = []
    yield started
    for process in started:
        await process.stop()


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """A minimal environment: nothing of the user's own home, config or credentials."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TMPDIR": str(home / "tmp"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "true",
        KEY_ENV: API_KEY,
    }
    for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME", "TMPDIR"):
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    env.update(extra)
    return env


# --- where a client connects -------------------------------------------------------------

def traced(argv: list[str], trace: Path | None) -> list[str]:
    """`argv` under strace, logging every connect() of every thread and child to `trace`."""
    if trace is None:
        return argv
    return ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace), *argv]


@pytest.fixture
def strace() -> str:
    found = shutil.which("strace")
    if found is None:
        pytest.skip("strace is not installed (Debian package strace): cannot watch which "
                    "addresses the client connects to")
    return found


_INET = re.compile(r'connect\(\d+, \{sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), '
                   r'(?:sin_addr=inet_addr\("([^"]+)"\)|[^}]*inet_pton\(AF_INET6, "([^"]+)")')


def network_connections(trace: Path) -> list[tuple[str, int]]:
    """(address, port) of every IPv4/IPv6 connect() in an strace log."""
    found = []
    for match in _INET.finditer(trace.read_text(errors="replace")):
        found.append((match.group(2) or match.group(3), int(match.group(1))))
    return found


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in {"::1", "::ffff:127.0.0.1"}


# --- Codex CLI ---------------------------------------------------------------------------

def codex_config(service: StudioService, **provider: int | str) -> str:
    """config.toml for `codex exec` against the port: the Responses wire, the key from
    KEY_ENV, no plugins (they would `git ls-remote` a public host), no analytics, no
    update check; `provider` adds settings of the model provider (timeouts, retries)."""
    lines = [
        f'model = "{MODEL_ID}"',
        'model_provider = "gguf-studio"',
        *CODEX_OFFLINE_ROOT,
        "",
        "[model_providers.gguf-studio]",
        'name = "GGUF Studio"',
        f'base_url = "{base_url(service)}"',
        f'env_key = "{KEY_ENV}"',
        'wire_api = "responses"',
    ]
    lines += [f"{name} = {json.dumps(value)}" for name, value in provider.items()]
    lines += CODEX_OFFLINE_TABLES
    return "\n".join(lines)


# What keeps `codex exec` from asking, updating or reaching out; root keys go before the
# first table of config.toml, the tables after the rest.
CODEX_OFFLINE_ROOT = ['approval_policy = "never"', 'sandbox_mode = "read-only"',
                      "check_for_update_on_startup = false"]
CODEX_OFFLINE_TABLES = ["", "[features]", "plugins = false", "", "[analytics]", "enabled = false", ""]


def pasted_codex_files(snippet: Snippet) -> dict[str, str]:
    """CODEX_HOME's files as the user pastes the Codex snippet (config.toml and any profile
    files), plus the suite's offline switches."""
    root, tables = snippet.text.split("\n\n", 1)
    files = {"config.toml": "\n".join([root, *CODEX_OFFLINE_ROOT, "", tables, *CODEX_OFFLINE_TABLES])}
    for extra in snippet.files:
        files[extra.where.removeprefix("~/.codex/")] = extra.text
    return files


class Codex:
    """`codex exec` in a throwaway CODEX_HOME and HOME."""

    def __init__(self, clients: Clients, root: Path, processes: list[Process]) -> None:
        self.clients = clients
        self.root = root
        self.processes = processes

    async def start(self, service: StudioService, prompt: str, *,
                    timeout: float = CLIENT_TIMEOUT, trace: Path | None = None,
                    files: dict[str, str] | None = None, args: tuple[str, ...] = (),
                    env: dict[str, str] | None = None, ephemeral: bool = True,
                    continuing: Run | None = None, **provider: int | str) -> Process:
        """`files`: CODEX_HOME's files by name, instead of `codex_config`'s config.toml;
        `args`: more options of `codex exec`; `env`: more variables.  `ephemeral=False`
        keeps the session on disk, so that a later run `continuing` this one (in its dirs)
        may resume it (`args=("resume", SESSION_ID)`)."""
        run_dir = continuing.run_dir if continuing is not None else None
        if run_dir is None:
            run_dir = self.root / f"codex-{len(self.processes)}"
        home, codex_home, work = run_dir / "home", run_dir / "codex-home", run_dir / "work"
        for d in (home, codex_home, work):
            d.mkdir(parents=True, exist_ok=continuing is not None)
        for name, text in (files or {"config.toml": codex_config(service, **provider)}).items():
            (codex_home / name).write_text(text)
        run_env = clean_env(home, CODEX_HOME=str(codex_home), **(env or {}))
        argv = [str(self.clients.codex_bin), "exec", "--strict-config", "--skip-git-repo-check",
                *(("--ephemeral",) if ephemeral else ()), "--color", "never", "-C", str(work),
                *args, prompt]
        process = await Process.start(traced(argv, trace), env=run_env, cwd=work, timeout=timeout)
        process.run.run_dir = run_dir
        self.processes.append(process)
        return process

    async def run(self, service: StudioService, prompt: str, **kwargs) -> Run:
        return await (await self.start(service, prompt, **kwargs)).result()


@pytest.fixture
def codex(clients: Clients, tmp_path: Path, processes: list[Process]) -> Codex:
    return Codex(clients, tmp_path, processes)


# --- OpenCode ----------------------------------------------------------------------------

# Every switch that keeps OpenCode from reaching out or doing more than answering.
OPENCODE_OFFLINE = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",  # else it downloads the model catalogue
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",
    "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
    "OPENCODE_DISABLE_PROJECT_CONFIG": "1",  # no opencode.json from a parent dir of the test
    "OPENCODE_DISABLE_TERMINAL_TITLE": "1",
    "OPENCODE_DISABLE_AUTOCOMPACT": "1",
    "OPENCODE_DISABLE_PRUNE": "1",
}


def opencode_config(service: StudioService) -> dict:
    """opencode.json: one OpenAI-compatible provider (chat completions) at the port."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "model": f"gguf-studio/{MODEL_ID}",
        "small_model": f"gguf-studio/{MODEL_ID}",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "gguf-studio": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "GGUF Studio",
                "options": {"baseURL": base_url(service), "apiKey": f"{{env:{KEY_ENV}}}"},
                "models": {MODEL_ID: {"name": "Tiny test model"}},
            },
        },
    }


class OpenCode:
    """`opencode run` in throwaway XDG dirs, the prompt on stdin."""

    def __init__(self, clients: Clients, root: Path, processes: list[Process]) -> None:
        self.clients = clients
        self.root = root
        self.processes = processes

    async def start(self, service: StudioService, prompt: str, *,
                    timeout: float = CLIENT_TIMEOUT, args: tuple[str, ...] = (),
                    trace: Path | None = None, config: dict | None = None,
                    env: dict[str, str] | None = None, continuing: Run | None = None) -> Process:
        """`config`: opencode.json instead of `opencode_config`'s; `env`: more variables;
        `continuing`: an earlier run whose dirs (and so sessions) this one runs in, to
        continue its session (`args=("--session", ID)` or `("--continue",)`)."""
        run_dir = continuing.run_dir if continuing is not None else None
        fresh = run_dir is None
        if run_dir is None:
            run_dir = self.root / f"opencode-{len(self.processes)}"
        home, work = run_dir / "home", run_dir / "work"
        work.mkdir(parents=True, exist_ok=not fresh)
        env = clean_env(home, **OPENCODE_OFFLINE, **(env or {}))
        config_dir = Path(env["XDG_CONFIG_HOME"]) / "opencode"
        if fresh:
            config_dir.mkdir(parents=True)
            # OpenCode npm-installs @opencode-ai/plugin into its config dir at start unless
            # node_modules is there and package.json and package-lock.json both name it.
            plugin = self.clients.opencode_plugin_dir
            for name in ("package.json", "package-lock.json"):
                shutil.copyfile(plugin / name, config_dir / name)
            (config_dir / "node_modules").symlink_to(plugin / "node_modules",
                                                     target_is_directory=True)
        (config_dir / "opencode.json").write_text(json.dumps(config or opencode_config(service), indent=2))
        argv = [str(self.clients.opencode_bin), "run", *args]
        process = await Process.start(traced(argv, trace), env=env, cwd=work,
                                      stdin=prompt.encode() + b"\n",
                                      timeout=timeout)
        process.run.log_dir = Path(env["XDG_DATA_HOME"]) / "opencode" / "log"
        process.run.run_dir = run_dir
        self.processes.append(process)
        return process

    async def run(self, service: StudioService, prompt: str, **kwargs) -> Run:
        return await (await self.start(service, prompt, **kwargs)).result()


@pytest.fixture
def opencode(clients: Clients, tmp_path: Path, processes: list[Process]) -> OpenCode:
    return OpenCode(clients, tmp_path, processes)


# --- Claude Code -------------------------------------------------------------------------

#: Seconds one `claude -p` run may take: its ~4k-token prompt is read by SmolLM2 on one
#: engine thread (about 25 s here) before a word comes.
CLAUDE_TIMEOUT = 240.0

#: The output limit Claude Code is given (`CLAUDE_CODE_MAX_OUTPUT_TOKENS`).
CLAUDE_OUTPUT = 200

#: What keeps `claude -p` from reaching out: no telemetry, error reports, surveys, update
#: checks or feature flags (the first switch covers them; the others are the parts' own).
CLAUDE_OFFLINE = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
}


def claude_port_env(service: StudioService, model: str = SMOL_ID) -> dict[str, str]:
    """Claude Code at the port: its base URL (the SDK adds /v1/messages), the suite's key
    as its auth token (sent as `Authorization: Bearer`), every model alias it may ask for
    (main, the small fast one, haiku/sonnet/opus, subagents) pointed at `model`, and an
    output limit (it asks for 32,000 tokens, which SmolLM2 sometimes rambles towards)."""
    return {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{service.gateway_port}",
            "ANTHROPIC_AUTH_TOKEN": API_KEY, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(CLAUDE_OUTPUT),
            **claude_model_env(model)}


def claude_model_env(model: str) -> dict[str, str]:
    return {name: model for name in (
        "ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "ANTHROPIC_DEFAULT_FABLE_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")}


class ClaudeCode:
    """`claude -p PROMPT` in a throwaway HOME and CLAUDE_CONFIG_DIR, answering in JSON."""

    def __init__(self, clients: Clients, root: Path, processes: list[Process]) -> None:
        self.clients = clients
        self.root = root
        self.processes = processes

    async def start(self, service: StudioService, prompt: str, *,
                    timeout: float = CLAUDE_TIMEOUT, args: tuple[str, ...] = (),
                    output: str = "json", env: dict[str, str] | None = None,
                    port_env: bool = True, trace: Path | None = None,
                    continuing: Run | None = None) -> Process:
        """`args`: more options (`("--resume", ID)`, `("--continue",)`, `("--settings",
        FILE)`); `env`: more variables; `port_env=False` leaves out `claude_port_env` (the
        settings file says it all); `continuing`: an earlier run whose dirs (its sessions,
        its work dir) this one runs in."""
        run_dir = continuing.run_dir if continuing is not None else None
        if run_dir is None:
            run_dir = self.root / f"claude-{len(self.processes)}"
        home, work = run_dir / "home", run_dir / "work"
        work.mkdir(parents=True, exist_ok=continuing is not None)
        run_env = clean_env(home, **{"CLAUDE_CONFIG_DIR": str(home / ".claude"), **CLAUDE_OFFLINE,
                                     **(claude_port_env(service) if port_env else {}),
                                     **(env or {})})
        argv = [str(self.clients.claude_bin), "-p", "--output-format", output,
                *(("--verbose",) if output == "stream-json" else ()), *args, "--", prompt]
        process = await Process.start(traced(argv, trace), env=run_env, cwd=work,
                                      timeout=timeout)
        process.run.run_dir = run_dir
        self.processes.append(process)
        return process

    async def run(self, service: StudioService, prompt: str, **kwargs: Any) -> Run:
        return await (await self.start(service, prompt, **kwargs)).result()


def claude_result(run: Run) -> dict[str, Any]:
    """The `result` message of a `--output-format json` or `stream-json` run."""
    for line in reversed(run.stdout.splitlines()):
        if line.startswith("{"):
            message = json.loads(line)
            if message.get("type") == "result":
                return cast(dict[str, Any], message)
    raise AssertionError("no result message\n" + run.describe())


def claude_answered(run: Run) -> dict[str, Any]:
    """The result of a run that the port answered with the model's text, as Claude Code
    judged it: a success, or the one failure that is the model's own, an answer that
    went on past the output limit though Claude Code asked it (in three more requests of
    the same session) to finish (greedy SmolLM2 does this on some of Claude Code's
    prompts, depending on their paths and date)."""
    assert not run.timed_out, run.describe()
    result = claude_result(run)
    if result.get("api_error") == "max_output_tokens":
        assert result["usage"]["output_tokens"] >= CLAUDE_OUTPUT, run.describe()
        return result
    assert run.returncode == 0 and not result["is_error"], run.describe()
    assert result["result"].strip(), run.describe()
    return result


@pytest.fixture
def claude(clients: Clients, tmp_path: Path, processes: list[Process]) -> ClaudeCode:
    return ClaudeCode(clients, tmp_path, processes)


# --- named keys, as the user makes and hands them out -----------------------------------------

async def gguf_studio_keys(*args: str) -> str:
    """`gguf-studio keys ARGS` in a process of its own, as the user runs it; its stdout.

    It shares the test's config dir (XDG_CONFIG_HOME, set per test), and so the keys file
    a running port re-reads: a key made or revoked here applies there live."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("GGUF_STUDIO_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "keys", *args, cwd=REPO, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, f"gguf-studio keys {' '.join(args)}: exit {proc.returncode}\n{err.decode()}"
    return out.decode()


async def add_key(name: str, *options: str) -> str:
    """`gguf-studio keys add NAME OPTIONS`: the secret it prints (its only showing)."""
    return (await gguf_studio_keys("add", name, *options)).strip()


async def revoke_key(service: StudioService, name: str) -> None:
    """`gguf-studio keys revoke NAME`, then wait until the running port has seen it (it
    looks at the keys file twice a second)."""
    await gguf_studio_keys("revoke", name)

    def seen() -> bool:
        record = service.keys.get(name)
        return record is not None and record.revoked_at is not None

    await until(seen, 2.0, f"the port to see {name!r} revoked")


async def listed_keys(service: StudioService) -> dict[str, dict]:
    """`gguf-studio keys list --json` by name, once the port has saved its usage."""
    await service.usage.flush()
    return {entry["name"]: entry for entry in json.loads(await gguf_studio_keys("list", "--json"))}


def key_target(service: StudioService, secret: str) -> ClientTarget:
    """What the window's snippets are filled with for a named key: this port, its one model,
    the key's secret."""
    return ClientTarget(base_url(service), MODEL_ID, secret, context_length=CONTEXT,
                        max_output_tokens=OUTPUT_CAP)


def pasted_env(snippet: Snippet) -> dict[str, str]:
    """The variables the snippet's shell line (`export NAME=VALUE`) sets, as a shell would.
    The suite's own key variable is emptied: only the pasted key reaches the client."""
    words = shlex.split(snippet.shell)
    assert words[0] == "export", snippet.shell
    return {KEY_ENV: "", **dict(word.split("=", 1) for word in words[1:])}


async def scraped_metrics(service: StudioService) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as a scraper reads it (with the owner's key): value by (sample name,
    sorted labels)."""
    async with httpx.AsyncClient(timeout=30, headers=auth_headers()) as client:
        response = await client.get(f"http://127.0.0.1:{service.gateway_port}/metrics")
    assert response.status_code == 200, response.text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples}


def key_sample(metrics: dict, name: str, key: str, **labels: str) -> float | None:
    """One `gguf_studio_key_*` sample of `key` (None: the port shows none)."""
    return metrics.get((name, tuple(sorted({"key": key, **labels}.items()))))
