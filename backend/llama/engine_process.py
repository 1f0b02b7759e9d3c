"""One started llama-server process: its output copied to its log file and a tail, its
exit awaited or forced (SIGTERM, then SIGKILL), and the random key it requires, in a
private file that lives as long as the process; and what its output and exit code say
when it ends.  The supervisor (`backend.llama.supervisor`) decides when to start and stop
one."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import tempfile
from collections import deque
from pathlib import Path

from backend.llama.child_process import spawn
from backend.llama.environment import die_with_parent, engine_environment
from backend.llama.load import LogListener
from backend.llama.log import EngineLogFile, for_display, read_lines

__all__ = ["EngineKey", "EngineProcess", "describe_exit", "is_bind_failure", "reason_from_log"]

log = logging.getLogger("gguf_studio.supervisor")  # its records read as the supervisor's, as before


class EngineProcess:
    """A running llama-server and the task copying its output to the log file and tail."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, log_file: EngineLogFile,
                 on_line: LogListener, key: EngineKey) -> None:
        self.proc = proc
        self.key = key
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self._log_file = log_file
        self._on_line = on_line
        self._tail: deque[str] = deque(maxlen=200)
        self._reader = asyncio.create_task(self._copy_output())

    @classmethod
    async def start(cls, args: list[str], port: int, log_file: EngineLogFile, on_line: LogListener,
                    key: EngineKey) -> EngineProcess:
        log_file.write("$ " + " ".join(args))
        try:
            proc = await spawn(
                *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=_child_environment(),
                preexec_fn=die_with_parent(),
            )
        except BaseException:
            await asyncio.to_thread(log_file.close)
            raise
        return cls(proc, port, log_file, on_line, key)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    def tail(self, lines: int) -> list[str]:
        return list(self._tail)[-lines:]

    async def wait(self) -> int:
        return await self.proc.wait()

    async def drain_output(self) -> None:
        """Let the reader copy what the child wrote before it exited."""
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
        except (asyncio.TimeoutError, Exception):
            pass

    async def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after `timeout`."""
        if self.running:
            try:
                self.proc.terminate()
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("llama-server ignored SIGTERM for %gs; killing it", timeout)
                self.proc.kill()
                await self.proc.wait()
            except ProcessLookupError:
                pass
        self.key.forget()
        await self.drain_output()
        if not self._reader.done():
            self._reader.cancel()
        await asyncio.to_thread(self._log_file.close)

    async def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        async for line in read_lines(self.proc.stdout):
            self._log_file.write(line)
            shown = for_display(line)
            self._tail.append(shown)
            self._on_line(shown)


class EngineKey:
    """A random key for one engine start, in a 0600 file inside a 0700 directory of its
    own while the engine runs: other users cannot read it, and our own tools (bench/)
    can find it from the engine's command line."""

    def __init__(self, value: str, directory: Path) -> None:
        self.value = value
        self._directory: Path | None = directory

    @classmethod
    def create(cls) -> EngineKey:
        value = secrets.token_urlsafe(32)
        directory = Path(tempfile.mkdtemp(prefix="gguf-studio-engine-"))  # mode 0700
        fd = os.open(directory / "api-key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        return cls(value, directory)

    @property
    def path(self) -> Path:
        assert self._directory is not None
        return self._directory / "api-key"

    def forget(self) -> None:
        directory, self._directory = self._directory, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _child_environment() -> dict[str, str]:
    """The engine's processes' environment, minus what would give the engine's port
    another key than the one we set, or RPC workers the load did not ask for."""
    return {k: v for k, v in engine_environment().items()
            if k not in ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE", "LLAMA_ARG_RPC")}



def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def is_bind_failure(log_tail: str) -> bool:
    return "couldn't bind" in log_tail or "Address already in use" in log_tail


def reason_from_log(lines: list[str]) -> str:
    """The most telling error line of llama-server's output, for a one-line message."""
    keys = ("error", "failed", "invalid", "unable", "couldn't", "cannot")
    for line in reversed(lines):
        lowered = line.lower()
        if any(k in lowered for k in keys):
            text = line.strip()
            # llama-server prefixes lines with source locations; keep the message only.
            return text.split(": ", 1)[-1] if ": " in text else text
    return ""
