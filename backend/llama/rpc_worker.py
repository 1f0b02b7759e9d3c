"""llama.cpp's RPC backend: a worker lends its machine's devices to an engine elsewhere.

A worker is llama.cpp's `ggml-rpc-server`, built with the engine from the same pinned
sources (backend/llama/engine.py); `gguf-studio rpc-worker` runs one (`RpcWorker`).  A
load with workers (`LoadSettings.rpc`) gives llama-server `--rpc host:port,...`, and
llama.cpp then uses each worker's devices like local GPUs.

llama.cpp calls the RPC server insecure, and it is: it has no authentication and no
encryption, and a client may allocate memory on the worker and send it tensors and
graphs to run.  So a worker listens on loopback unless the user names another address
*and* says they accept that (`INSECURE_FLAG`), and says so plainly when it starts.

Before an engine starts, `check_rpc_workers` greets each worker the way llama.cpp does
(its HELLO handshake), so that a worker that cannot be reached, serves another engine
already (a worker serves one engine at a time) or speaks another protocol version gives
a sentence instead of an engine that aborts, or waits until the load times out.
`rpc_failure_reason` words the engine's own RPC errors for the cases that slip past
(a worker gone between the check and the load, or during it).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from backend.errors import RpcWorkerFailed, RpcWorkerRefused
from backend.llama.child_process import spawn
from backend.llama.environment import die_with_parent, engine_environment
from backend.llama.log import for_display, read_lines

__all__ = ["INSECURE_FLAG", "RpcProtocol", "RpcWorker", "check_rpc_workers",
           "check_worker_address", "hello", "insecurity_warning", "protocol_of_engine",
           "protocol_of_sources", "rpc_failure_reason", "worker_command"]

#: The flag that lets a worker listen beyond loopback.
INSECURE_FLAG = "--i-understand-rpc-is-insecure"


def insecurity_warning(host: str, port: int) -> str:
    """What a worker says when it starts, wherever it listens."""
    where = ("this machine only (loopback)" if _is_loopback(host) else
             f"every machine that can reach {host}:{port}")
    return (
        f"WARNING: llama.cpp's RPC is insecure. This worker accepts {where}, with no key and "
        "no encryption: anyone who can reach this port can allocate memory here and run "
        "code paths of the engine on data they send, and can read what it computes. Use "
        "it on a trusted wired network only, never on Wi-Fi you share or the internet, and "
        "keep the port closed to everyone else (firewall).")


@dataclass(frozen=True, order=True)
class RpcProtocol:
    """The version of llama.cpp's RPC protocol a build speaks (ggml/include/ggml-rpc.h)."""

    major: int
    minor: int
    patch: int = 0

    def serves(self, client: "RpcProtocol") -> bool:
        """Whether a worker of this version can serve an engine of `client`'s (llama.cpp's
        own rule: the same major version, and no minor version newer than the client's)."""
        return self.major == client.major and self.minor <= client.minor

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def protocol_of_sources(tree: Path) -> RpcProtocol | None:
    """The protocol of the llama.cpp sources in `tree`, for the engine's record."""
    try:
        header = (tree / "ggml" / "include" / "ggml-rpc.h").read_text(errors="replace")
    except OSError:
        return None
    found = {m.group(1): int(m.group(2)) for m in _PROTO_DEFINE.finditer(header)}
    if "MAJOR" not in found or "MINOR" not in found:
        return None
    return RpcProtocol(found["MAJOR"], found["MINOR"], found.get("PATCH", 0))


def protocol_of_engine(llama_server: Path) -> RpcProtocol | None:
    """The protocol a managed engine was built with (its engine.json); None when unknown."""
    try:
        data = json.loads((llama_server.parent / "engine.json").read_text())
        major, minor, patch = data["rpc_protocol"]
        return RpcProtocol(int(major), int(minor), int(patch))
    except (OSError, ValueError, KeyError, TypeError):
        return None


async def hello(worker: str, *, connect_timeout: float = 10.0,
                answer_timeout: float = 5.0) -> RpcProtocol:
    """Greet `worker` ("host:port") with llama.cpp's HELLO and return its protocol.
    Raises RpcWorkerFailed, saying why, when it cannot be reached or does not answer."""
    host, _, port = worker.rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), family=socket.AF_INET), connect_timeout)
    except asyncio.TimeoutError:
        raise RpcWorkerFailed(
            f"RPC worker {worker} cannot be reached: no answer to connecting within "
            f"{connect_timeout:g} seconds. {_REACH_HINT}") from None
    except OSError as exc:
        raise RpcWorkerFailed(
            f"RPC worker {worker} cannot be reached ({_os_reason(exc)}). {_REACH_HINT}") from None
    try:
        writer.write(struct.pack("<BQ", _CMD_HELLO, _CAPS_SIZE) + bytes(_CAPS_SIZE))
        try:
            await writer.drain()
            answer = await asyncio.wait_for(reader.readexactly(8 + 4 + _CAPS_SIZE), answer_timeout)
        except asyncio.TimeoutError:
            # The greeting waits in the worker's queue; closed plainly, the worker would
            # answer it once free and die of SIGPIPE (it does not ignore that signal).  A
            # reset connection is dropped without an answer.
            writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raise RpcWorkerFailed(
                f"RPC worker {worker} does not answer: it is most likely serving another "
                "engine already (a worker serves one engine at a time). Start another "
                "`gguf-studio rpc-worker` (another port or machine) for this model, or "
                "unload the model that uses it.") from None
        except (OSError, asyncio.IncompleteReadError):
            raise RpcWorkerFailed(
                f"RPC worker {worker} closed the connection without answering: it is not "
                "an RPC worker of a GGUF Studio engine (or one too old to greet).") from None
        size, major, minor, patch = struct.unpack("<QBBB", answer[:11])
        if size != 4 + _CAPS_SIZE:
            raise RpcWorkerFailed(f"RPC worker {worker} answered in a form this engine does "
                                  f"not speak: {_SAME_VERSION_HINT}")
        return RpcProtocol(major, minor, patch)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def check_rpc_workers(workers: Sequence[str], engine_protocol: RpcProtocol | None = None,
                            **timeouts: float) -> None:
    """Every worker answers and can serve this engine; else RpcWorkerFailed for the first
    that cannot.  Greets them one after another: a worker answers at once when it can."""
    for worker in workers:
        protocol = await hello(worker, **timeouts)
        if engine_protocol is not None and not protocol.serves(engine_protocol):
            raise RpcWorkerFailed(
                f"RPC worker {worker} speaks RPC protocol {protocol}, this engine "
                f"{engine_protocol}: {_SAME_VERSION_HINT}")


def rpc_failure_reason(lines: Sequence[str]) -> str | None:
    """A sentence for an engine that stopped over RPC, from its output; None otherwise."""
    text = "\n".join(lines)
    for pattern, words in _ENGINE_FAILURES:
        m = re.search(pattern, text)
        if m:
            return words.format(worker=m.groupdict().get("worker") or "an RPC worker")
    return None


def check_worker_address(host: str, port: int, accept_risk: bool) -> None:
    """Raises RpcWorkerRefused unless a worker may listen on `host`: an IPv4 address (the
    RPC server binds IPv4 only), beyond loopback only with `accept_risk`."""
    if not 1 <= port <= 65535:
        raise RpcWorkerRefused(f"--port {port} is not a port; give a number from 1 to 65535.")
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise RpcWorkerRefused(
            f"--host {host[:80]!r} is not an IPv4 address; llama.cpp's RPC server binds an "
            "IPv4 address only (127.0.0.1, this machine's address on the wired network, or "
            "0.0.0.0 for all).") from None
    if not address.is_loopback and not accept_risk:
        raise RpcWorkerRefused(
            f"Refusing to listen on {host}: llama.cpp's RPC has no key and no encryption, so "
            "anyone who can reach the port could use this machine's memory and devices. "
            f"If this machine is on a trusted wired network, start it with {INSECURE_FLAG}.")


def worker_command(binary: Path, host: str, port: int, threads: int) -> list[str]:
    return [str(binary), "--host", host, "--port", str(port), "--threads", str(threads)]


def _sigpipe_ignored(argv: list[str]) -> list[str]:
    """`argv` run with SIGPIPE ignored, as `restore_signals=False` means: under uvloop,
    libuv resets every signal in the child to its default (SIGPIPE's ends the worker when
    a client leaves before its answer), so a shell ignores it and becomes the worker."""
    if os.name != "posix":
        return argv
    return ["/bin/sh", "-c", 'trap "" PIPE; exec "$0" "$@"', *argv]


class RpcWorker:
    """One running `ggml-rpc-server`, with its output passed to `on_line`."""

    def __init__(self, proc: asyncio.subprocess.Process, endpoint: str,
                 on_line: Callable[[str], None]) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.protocol: RpcProtocol | None = None
        self._on_line = on_line
        self._own_greeting = list(_GREETING_LINES)  # what `start`'s check makes it print
        #: The last lines the server printed (for the reason when it stops).
        self.output: list[str] = []
        self._reader = asyncio.create_task(self._copy_output())

    @classmethod
    async def start(cls, binary: Path, host: str, port: int, threads: int,
                    on_line: Callable[[str], None], *, timeout: float = 60.0) -> "RpcWorker":
        """Start the server and return once it answers a HELLO on its port.  Raises
        RpcWorkerRefused when the port is taken, or the server stops first (its reason
        from its own output)."""
        _check_port_free(host, port)
        # Its own session (spawn's): Ctrl-C reaches us, and we stop it (and say so) ourselves.
        proc = await spawn(
            *_sigpipe_ignored(worker_command(binary, host, port, threads)),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env=engine_environment(), preexec_fn=die_with_parent(),
            # SIGPIPE stays ignored, as Python has it: a client gone while the server
            # answers (an engine killed mid-reply) must not end the worker.
            restore_signals=False)
        worker = cls(proc, f"{host}:{port}", on_line)
        try:
            await asyncio.wait_for(worker._until_answering(), timeout)
        except BaseException:
            await worker.stop()
            raise
        return worker

    async def wait(self) -> int:
        code = await self.proc.wait()
        await asyncio.gather(self._reader, return_exceptions=True)
        return code

    async def stop(self, timeout: float = 10.0) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.terminate()
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
            except ProcessLookupError:
                pass
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _until_answering(self) -> None:
        exited = asyncio.ensure_future(self.proc.wait())
        try:
            while True:
                greeted = asyncio.ensure_future(
                    hello(_reachable(self.endpoint), connect_timeout=2.0, answer_timeout=5.0))
                await asyncio.wait({greeted, exited}, return_when=asyncio.FIRST_COMPLETED)
                if greeted.done() and greeted.exception() is None and not exited.done():
                    self.protocol = greeted.result()
                    return
                if exited.done():
                    greeted.cancel()
                    await asyncio.gather(greeted, self._reader, return_exceptions=True)
                    reason = next((line for line in reversed(self.output)
                                   if any(word in line.lower() for word in _FAILURE_WORDS)), "")
                    raise RpcWorkerRefused(
                        f"The RPC server stopped before it listened on {self.endpoint}"
                        + (f": {reason}" if reason else "")
                        + (" (is the port in use, or the address not this machine's?)"
                           if "socket" in reason.lower() else "."))
                await asyncio.sleep(0.05)  # not listening yet: try again
        finally:
            if not exited.done():
                exited.cancel()

    async def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        async for line in read_lines(self.proc.stdout):
            shown = for_display(line.rstrip())
            if self._own_greeting and shown == self._own_greeting[0]:
                # The first client is `start` checking that the server answers.
                self._own_greeting.pop(0)
                continue
            self.output.append(shown)
            del self.output[:-50]
            self._on_line(shown)


# --- helpers --------------------------------------------------------------------------------

_GREETING_LINES = ("Accepted client connection", "Client connection closed")
_CMD_HELLO = 14  # llama.cpp: "RPC_CMD_HELLO must be always 14"
_CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE: zeros ask for plain TCP
_PROTO_DEFINE = re.compile(r"#define\s+RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)")
_FAILURE_WORDS = ("failed", "error", "invalid", "unknown", "cannot")

_REACH_HINT = ("Start `gguf-studio rpc-worker` there (with --host set to an address this "
               "machine can reach) and check that its port is open to this machine.")
_SAME_VERSION_HINT = ("run the same version of GGUF Studio (and rebuild its engine with "
                      "`gguf-studio engine build`) on both machines.")

# llama-server's own words when RPC fails (ggml-rpc.cpp, common/arg.cpp), first match wins.
_ENGINE_FAILURES = (
    (r"RPC not supported in this build",
     "This llama-server was built without RPC, so it cannot use RPC workers. "
     "`gguf-studio engine build` builds an engine with it (or use one built with "
     "-DGGML_RPC=ON)."),
    (r"Failed to connect to (?P<worker>\S+)",
     f"RPC worker {{worker}} cannot be reached. {_REACH_HINT}"),
    (r"Cannot resolve host '(?P<worker>[^']*)'",
     "The RPC worker host {worker} cannot be resolved; give its IPv4 address instead."),
    (r"RPC server version mismatch|RPC handshake failed for (?P<worker>\S+)",
     f"RPC worker {{worker}} speaks another RPC protocol version: {_SAME_VERSION_HINT}"),
    (r"Remote RPC server crashed or returned malformed response",
     "An RPC worker stopped or dropped its connection; check the worker's machine and "
     "its output."),
)


def _reachable(endpoint: str) -> str:
    """Where to greet a server that listens on `endpoint`: 0.0.0.0 is reached on loopback."""
    host, _, port = endpoint.rpartition(":")
    return f"127.0.0.1:{port}" if host == "0.0.0.0" else endpoint


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused: nothing listens on that port"
    if isinstance(exc, socket.gaierror):
        return "its host name cannot be resolved"
    return exc.strerror or str(exc) or type(exc).__name__


def _check_port_free(host: str, port: int) -> None:
    """The RPC server reports a taken port only by stopping; say it before starting it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise RpcWorkerRefused(
                f"Cannot listen on {host}:{port}: "
                + ("the port is in use (another worker?); choose another with --port."
                   if exc.errno == errno.EADDRINUSE else
                   f"{exc.strerror or exc} (is {host} an address of this machine?)")) from None
