"""The processes the relay benchmark starts and measures, each on its own.

The port (`gguf-studio serve --upstream URL`, or a patched variant of it), the helper
relays under `bench/` (tcp-proxy, naive-relay), the synthetic upstream and llama-server
are all started through `Processes`; the CPU each spends is read from /proc/<pid>/stat.
Only loopback addresses are used; `stop_all` ends every one of them.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

REPO = Path(__file__).resolve().parent.parent

HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PYTHON = sys.executable


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if this benchmark dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Processes:
    """Every child process of the benchmark; `stop_all` ends them (TERM, then KILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str],
              env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        try:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        finally:
            log.close()
        self.children.append((name, proc))
        return proc

    def log_of(self, name: str) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, proc: subprocess.Popen, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop_all(self) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for _, proc in reversed(self.children):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.children.clear()

    def wait_for_line(self, name: str, proc: subprocess.Popen, pattern: str,
                      timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            match = regex.search(self.log_of(name))
            if match:
                return match
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{name} did not start (exit {proc.poll()}):\n"
                           f"{self.log_of(name)[-3000:]}")


def get_json(port: int, path: str, timeout: float = 2.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, None
    finally:
        conn.close()


def wait_until(check: Callable[[], bool], proc: subprocess.Popen, what: str, procs: Processes,
               name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if check():
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} (exit {proc.poll()}):\n{procs.log_of(name)[-3000:]}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of `pid` in seconds, from /proc/<pid>/stat (10 ms ticks, usually)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_ns(pid: int) -> int:
    """Nanoseconds on a CPU of every thread of `pid` so far (/proc/<pid>/task/*/schedstat:
    the scheduler's clock, not 10 ms ticks; a thread that ended is no longer counted)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    return total


class CpuMeter:
    """The CPU seconds each named process spends from now until `spent()`: `{name: user +
    system, name + "_sys": system}`, and `"client"` (this process) when `client` is set."""

    def __init__(self, pids: dict[str, int], *, client: bool = False) -> None:
        self.pids = pids
        self._before = {name: cpu_times(pid) for name, pid in pids.items()}
        self._client = time.process_time() if client else None

    def spent(self) -> dict[str, float]:
        cpu = {}
        for name, pid in self.pids.items():
            user, system = cpu_times(pid)
            cpu[name] = user + system - sum(self._before[name])
            cpu[name + "_sys"] = system - self._before[name][1]
        if self._client is not None:
            cpu["client"] = time.process_time() - self._client
        return cpu


def port_env(config_dir: Path) -> dict[str, str]:
    """The environment of a `gguf-studio serve`: no saved settings, no GGUF_STUDIO_* leaking
    in, and nothing written to the user's own data (request history, keys, parked slots):
    its data and state live beside `config_dir`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env["XDG_CONFIG_HOME"] = str(config_dir)
    env["XDG_DATA_HOME"] = str(config_dir.with_name(config_dir.name + "-data"))
    env["XDG_STATE_HOME"] = str(config_dir.with_name(config_dir.name + "-state"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Target:
    name: str
    port: int
    pid: int | None  # the relay's process (None: direct to the upstream)


def start_port(procs: Processes, name: str, upstream: str | list[str], slots: int,
               config_dir: Path, patch: str | None = None, extra: list[str] | None = None,
               env: dict[str, str] | None = None) -> Target:
    """`gguf-studio serve --upstream URL [--upstream URL ...]` in its own process; ready
    once it reports `slots` in all (`/health`'s `effective_parallel_slots`, or the sum
    over its `engines` where it lists them).  `env`: more variables for it (e.g.
    `BENCH_CHECKOUT` for `bench/variants/checkout_port.py`)."""
    upstreams = [upstream] if isinstance(upstream, str) else upstream
    serve = ["serve", *(arg for url in upstreams for arg in ("--upstream", url)),
             "--host", HOST, "--port", "0", "--max-output-tokens", "0", *(extra or [])]
    if patch:  # a file that patches the port, then runs backend.app.cli.main(sys.argv[1:])
        cmd = [PYTHON, patch, *serve]
    else:
        cmd = [PYTHON, "-m", "backend.app.cli", *serve]
    proc = procs.start(name, cmd, env={**port_env(config_dir), **(env or {})})
    port = int(procs.wait_for_line(name, proc, r"http://127\.0\.0\.1:(\d+)/v1").group(1))

    def ready() -> bool:
        status, body = get_json(port, "/health")
        return status == 200 and health_slots(body) == slots

    try:
        wait_until(ready, proc, f"{name} did not become ready with {slots} slots", procs, name)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n/health answered: {_health_text(port)}") from None
    # Admission counts prompts only when it knows the engine's KV cache: measured with it on.
    if get_json(port, "/health")[1].get("kv") is None:
        raise RuntimeError(f"{name} knows no KV cache of its upstream: prompt counting is off")
    return Target(name, port, proc.pid)


def health_slots(body: Any) -> int | None:
    """The slots a port's `/health` reports in all: the sum over the ready engines of
    every model where it lists them (a pool), else its `effective_parallel_slots`."""
    if not isinstance(body, dict):
        return None
    models = body.get("models")
    if isinstance(models, list):
        total = sum(engine.get("slots") or 0
                    for model in models if isinstance(model, dict)
                    for engine in model.get("engines") or []
                    if isinstance(engine, dict) and engine.get("state") == "ready")
        if total:
            return total
    slots = body.get("effective_parallel_slots")
    return slots if isinstance(slots, int) else None


def _health_text(port: int) -> str:
    try:
        return json.dumps(get_json(port, "/health")[1])[:300]
    except (OSError, http.client.HTTPException):
        return "no answer"


def start_fake(procs: Processes, name: str, slots: int, ctx: int,
               enforce_slots: bool = False) -> tuple[Target, subprocess.Popen]:
    """The synthetic upstream (`python -m tests.fake_upstream`) in its own process; `ctx`
    is the per-slot context its `/props` reports (an attached port takes it as one pool)."""
    cmd = [PYTHON, "-m", "tests.fake_upstream", "--host", HOST, "--port", "0",
           "--slots", str(slots), "--n-ctx", str(ctx)]
    if enforce_slots:
        cmd.append("--enforce-slots")
    proc = procs.start(name, cmd)
    port = int(procs.wait_for_line(name, proc,
                                   r"fake llama-server on http://127\.0\.0\.1:(\d+)").group(1))
    return Target(name, port, None), proc


def start_helper(procs: Processes, name: str, script: str, upstream: str, banner: str) -> Target:
    proc = procs.start(name, [PYTHON, str(REPO / "bench" / script), "--upstream", upstream,
                              "--port", "0"])
    port = int(procs.wait_for_line(name, proc, banner + r" on http://127\.0\.0\.1:(\d+)").group(1))
    return Target(name, port, proc.pid)


def stop_children(procs: Processes) -> None:
    for _, proc in list(procs.children):
        procs.stop(proc)
    procs.children.clear()


def run_bench(main_async: Callable[[Any, Processes, Path], Awaitable[int]], args: Any,
              prefix: str, *, config_dir: bool = False) -> int:
    """`main_async(args, procs, work)` in a fresh work directory (with a `config` dir in it
    when `config_dir`): SIGTERM ends it as Ctrl-C does, a RuntimeError is the bench's
    failure (exit 1), and on the way out every child process is stopped and the directory
    removed (kept, and said, with `args.keep_logs`)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    if config_dir:
        (work / "config").mkdir()
    procs = Processes(work)

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        return asyncio.run(main_async(args, procs, work))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        if args.keep_logs:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
