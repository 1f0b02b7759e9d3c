"""`gguf-studio engine status|path|build`, `inspect MODEL` and `rpc-worker`: the engine,
a model file and this machine's devices from the command line.

Which llama-server is used and why, and the accelerators found (`engine status`), building
one (`engine build`, its progress on one line when a terminal shows it); a GGUF file's
metadata, its strings escaped (`inspect`); and llama.cpp's RPC server lent to an engine
on another machine (`rpc-worker`: insecure, loopback unless told otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any

from backend import event_loop
from backend.llama.accelerators import BACKENDS
from backend.llama.engine import BuildProgress, Engine
from backend.models.hf_cache import printable_lines

__all__ = ["add_engine_parsers", "add_rpc_worker_parser"]


def add_engine_parsers(sub: Any) -> None:
    """`gguf-studio engine status|path|build` and `gguf-studio inspect`."""
    engine = sub.add_parser("engine", help="find or build llama-server")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    for name, fn, text in (("status", _engine_status, "which llama-server is used, and why"),
                           ("path", _engine_path, "print the llama-server that would be used"),
                           ("build", _engine_build, "build the managed llama-server from source")):
        e = engine_sub.add_parser(name, help=text)
        e.add_argument("--llama-server", help="an explicit llama-server binary")
        e.add_argument("-v", "--verbose", action="store_true")
        e.set_defaults(run=fn)
        if name == "status":
            e.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "build":
            e.add_argument("--backend", choices=BACKENDS,
                           help="engine to build (default: the best this machine can build)")
            e.add_argument("--cmake-arg", action="append", metavar="FLAG",
                           help="extra CMake flag, e.g. -DGGML_NATIVE=OFF (repeatable)")
            e.add_argument("-j", "--jobs", type=int, default=None)

    inspect = sub.add_parser("inspect", help="show a GGUF file's metadata")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(run=_inspect)


def add_rpc_worker_parser(sub: Any) -> None:
    """`gguf-studio rpc-worker`."""
    from backend.llama.rpc_worker import INSECURE_FLAG
    from backend.rpc_workers import DEFAULT_PORT

    worker = sub.add_parser(
        "rpc-worker", help="lend this machine's memory and devices to an engine on another "
        "machine (llama.cpp RPC; insecure: trusted wired network only)",
        description="Runs llama.cpp's RPC server from this machine's engine, so that a "
        "`serve --rpc HOST:PORT` on another machine spreads its model over this one. "
        "llama.cpp's RPC has no key and no encryption: anyone who can reach the port can use "
        "this machine's memory and devices. It listens on 127.0.0.1 unless told otherwise.")
    worker.add_argument("--host", default="127.0.0.1",
                        help="IPv4 address to listen on (default 127.0.0.1; another needs "
                        f"{INSECURE_FLAG})")
    worker.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port to listen on (default {DEFAULT_PORT})")
    worker.add_argument("--threads", type=int, default=0,
                        help="CPU threads of the worker's CPU device, 0 = every core but one")
    worker.add_argument(INSECURE_FLAG, action="store_true",
                        help="listen on an address other machines can reach: only on a "
                        "trusted wired network, with the port closed to everyone else")
    worker.add_argument("--rpc-server", metavar="PATH",
                        help="a ggml-rpc-server binary (default: the one of this machine's "
                        "engine, built by `gguf-studio engine build`)")
    worker.set_defaults(run=_rpc_worker)


# --- engine -------------------------------------------------------------------------------


def _engine_status(args: argparse.Namespace) -> int:
    from backend.llama.engine import detect_accelerators

    engine = Engine()
    resolution = engine.resolve(args.llama_server)
    accelerators = detect_accelerators()
    if args.json:
        chosen = resolution.chosen
        print(json.dumps({
            "chosen": {"source": chosen.source, "path": str(chosen.path)} if chosen else None,
            "candidates": [{"source": c.source, "path": str(c.path) if c.path else None,
                            "usable": c.usable, "reason": c.reason} for c in resolution.candidates],
            "installed": {b: str(p) for b, p in engine.installed_backends().items()},
            "accelerators": accelerators.to_dict(),
        }, indent=2))
        return 0 if chosen else 1
    for line in resolution.describe():
        print(line)
    print("accelerators (backend, usable here, why):")
    for line in accelerators.describe():
        print(line)
    print(f"best engine this machine can build: {accelerators.best_buildable()} "
          f"(gguf-studio engine build --backend {accelerators.best_buildable()})")
    return 0 if resolution.chosen else 1


def _engine_path(args: argparse.Namespace) -> int:
    print(Engine().resolve(args.llama_server).path)
    return 0


def _engine_build(args: argparse.Namespace) -> int:
    printer = _ProgressPrinter(verbose=args.verbose)
    from backend.llama.engine import detect_accelerators

    backend = args.backend or detect_accelerators().best_buildable()
    print(f"building the {backend} engine", flush=True)
    path = asyncio.run(Engine().build(args.cmake_arg or (), printer, jobs=args.jobs,
                                      backend=backend))
    printer.finish()
    print(path)
    return 0


class _ProgressPrinter:
    """Percent on one line when a terminal shows it; every 5 % as its own line otherwise."""

    def __init__(self, verbose: bool = False) -> None:
        self.tty = sys.stdout.isatty()
        self.verbose = verbose
        self._last: tuple[str, int] | None = None

    def __call__(self, p: BuildProgress) -> None:
        if self.verbose:
            print(f"[{p.percent:5.1f}%] {p.line}", flush=True)
        elif self.tty:
            sys.stdout.write(f"\r[{p.percent:5.1f}%] {p.phase:<9} {p.line[:60]:<60}")
            sys.stdout.flush()
        elif (p.phase, int(p.percent) // 5) != self._last:
            self._last = (p.phase, int(p.percent) // 5)
            print(f"[{p.percent:5.1f}%] {p.phase}: {p.line[:100]}", flush=True)

    def finish(self) -> None:
        if self.tty and not self.verbose:
            print()


# --- inspect --------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    from backend.models.gguf_info import read_model_info

    info = read_model_info(args.path)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
    else:
        # general.name and the other strings are the file's: shown escaped.
        print(printable_lines("\n".join(info.summary_lines())))
    return 0


# --- RPC worker -------------------------------------------------------------------------------


def _rpc_worker(args: argparse.Namespace) -> int:
    from backend.llama.rpc_worker import check_worker_address, insecurity_warning
    from backend.llama.supervisor import default_threads

    check_worker_address(args.host, args.port, args.i_understand_rpc_is_insecure)
    binary = Engine().rpc_server(args.rpc_server)
    print(insecurity_warning(args.host, args.port), file=sys.stderr, flush=True)
    try:
        return event_loop.run(_rpc_worker_async(binary, args.host, args.port,
                                                args.threads or default_threads()))
    except KeyboardInterrupt:
        return 0


async def _rpc_worker_async(binary: Any, host: str, port: int, threads: int) -> int:
    from backend.llama.rpc_worker import RpcWorker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    worker = await RpcWorker.start(binary, host, port, threads, lambda line: print(line, flush=True))
    try:
        reach = "127.0.0.1" if host in ("127.0.0.1", "0.0.0.0") else host
        print(f"RPC worker ready on {host}:{port} (RPC protocol {worker.protocol}). On the "
              f"engine's machine: gguf-studio serve --model MODEL --rpc {reach}:{port}"
              + (" (with this machine's address)" if host == "0.0.0.0" else ""), flush=True)
        exited = asyncio.create_task(worker.wait())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if exited.done():
            code = exited.result()
            print(f"gguf-studio: the RPC server stopped (exit {code}).", file=sys.stderr)
            return code or 1
        print("stopping", flush=True)
        return 0
    finally:
        await worker.stop()
