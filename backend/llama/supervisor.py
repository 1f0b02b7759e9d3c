"""One llama-server process: start, health, slots, logs, stop, restart.

One asyncio task owns the child process for the whole life of a load.  Every change of
state goes through `_set_state`, which notifies listeners.  The health wait races the
child's exit, the deadline and cancellation, each ending with its own error.

While ready, /health is asked every `health_interval` seconds; an engine that fails to
answer within `health_timeout`, `health_failures` times in a row (hung, or stopped with
SIGSTOP) is killed and restarted like a crashed one.  Restarts are bounded over time: at
most `max_restarts` within any `restart_window` seconds, whatever the engine's uptime in
between (a request that crashes the engine after a minute of work must not reload it
forever); past the bound the load fails and says so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

from backend.llama.accelerators import cpu_claims_amx
from backend.llama.api import EngineClient, EngineProps
from backend.llama.chat_template import chat_template_args
from backend.llama.engine_speed import (DEFAULT_BATCH, DEFAULT_STALL_BUDGET, DEFAULT_UBATCH,
                                        EngineSpeed, choose_batch, measure_speed)
from backend.llama.engine_process import (EngineKey, EngineProcess, describe_exit,
                                          is_bind_failure, reason_from_log)
from backend.llama.log import EngineLogFile
from backend.llama.report import EngineReportReader, gpu_failure_reason
from backend.llama.rpc_worker import check_rpc_workers, protocol_of_engine, rpc_failure_reason
from backend.llama.slot_actions import SlotActionFailed, SlotClient
from backend.errors import (
    EngineExitedDuringLoad,
    GpuLoadFailed,
    LoadError,
    LoadSuperseded,
    LoadTimedOut,
    RpcWorkerFailed,
)
from backend.gpu_layers import NONE, gpu_layer_args
from backend.listeners import Listeners
from backend.llama.kv_capacity import context_args, kv_from_props
from backend.llama.load import (OWNED_FLAGS, LoadSpec, LogListener, Serving, Snapshot,
                                SnapshotPublisher, State)

__all__ = ["CHECKPOINT_FLAGS", "CONTEXT_CHECKPOINTS", "OWNED_FLAGS", "PREFIX_CACHE_ARGS",
           "PREFIX_CACHE_NOTE", "Supervisor", "build_command",
           "default_threads", "pick_free_port"]

#: How the engine picks a slot, with the port pinning every request to a slot that has
#: held a prompt (see backend.admission.placement): no slot is ever "similar enough"
#: (a similarity of 1), so a pinned request always saves the slot's prompt to the RAM
#: prompt cache and loads the best match for its own (its slot's, when that is its own
#: prefix; tools/server/server-context.cpp `get_available_slot`), and an unpinned one
#: takes the least recently used slot and does the same.  llama-server's default (0.1)
#: picks the idle slot whose prompt is most similar, with no cache load: agents sharing
#: a long head take each other's slots and recompute their histories; 0 would make a
#: pinned request skip the cache.
PREFIX_CACHE_ARGS = ("--slot-prompt-similarity", "1")
#: Context checkpoints a slot keeps (`--ctx-checkpoints`, unless the operator's arguments
#: say): copies of what a sliding-window or recurrent layer cannot roll back, which
#: llama-server takes near the end of each prompt (and at the last user message) and
#: rolls back to when the next prompt parts from the cached one there.  Measured through
#: the port (bench/sessions.py, Gemma 3 270M, the tiny qwen35 hybrid and gpt-oss): 4
#: keep every live and parked prefix as llama.cpp's 32 do (8 sessions on 2 slots, the
#: first turn after an unload or a restart: the same figures), in an eighth of the RAM
#: and of the parked files (Gemma 3 270M: 7.5 MiB a checkpoint, its 5-turn sessions'
#: parked files 136-159 MB with 32, 55 MB with 4; a 12B Gemma's would be ~320 MiB each).
CONTEXT_CHECKPOINTS = 4
CHECKPOINT_FLAGS = ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints")
#: Why, for the Model tab.
PREFIX_CACHE_NOTE = ("Prompt prefixes: the port sends each session back to the slot "
                     "holding its prefix; other requests take the least recently used "
                     "slot and reload their prefix from the engine's RAM prompt cache "
                     "(measured through the port, 3 agents on 2 slots computed 0.97x "
                     "their new tokens, against 1.88x with llama-server's own slot "
                     "choice).")


log = logging.getLogger("gguf_studio.supervisor")


class Supervisor(SnapshotPublisher):
    """Runs at most one llama-server and keeps it alive while it is wanted."""

    def __init__(self, binary: Path | str, log_dir: Path, *, load_timeout: float = 300.0,
                 stop_timeout: float = 10.0, max_restarts: int = 5,
                 restart_backoff: Sequence[float] = (0.5, 1.0, 2.0, 4.0, 8.0),
                 restart_window: float = 600.0, health_interval: float = 5.0,
                 health_timeout: float = 5.0, health_failures: int = 3,
                 log_max_bytes: int = 8 << 20, log_keep_starts: int = 5,
                 port_picker: Callable[[], int] | None = None,
                 output_cap: Callable[[], int] = lambda: 0,
                 slot_save_dir: Callable[[], Path | None] = lambda: None,
                 stall_budget: Callable[[], float] = lambda: DEFAULT_STALL_BUDGET,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.binary = Path(binary)
        #: Where the engine saves and restores slots (parked prefixes), made at each start.
        self.slot_save_dir = slot_save_dir
        self._slot_dir: Path | None = None  #: the current start's (`slot_save_dir`'s answer)
        #: The longest a running stream may wait for one step (seconds; 0: no budget),
        #: read at each load (backend.llama.engine_speed).
        self.stall_budget = stall_budget
        # Each load's measured speed and batch choice, by load and budget: the batch is
        # fixed at the engine's start, so a load measured once starts with its batch.
        self._speeds: dict[tuple[LoadSpec, float], EngineSpeed] = {}
        #: The operator's output cap (0: none), read at each start of the engine.
        self.output_cap = output_cap
        self.log_dir = Path(log_dir)
        self.load_timeout = load_timeout
        self.stop_timeout = stop_timeout
        self.max_restarts = max_restarts
        self.restart_backoff = tuple(restart_backoff)
        self.restart_window = restart_window
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.health_failures = health_failures
        self._clock = clock
        # Per model: the newest `log_keep_starts` starts, each at most 2 x `log_max_bytes`.
        self.log_max_bytes = log_max_bytes
        self.log_keep_starts = log_keep_starts
        self._pick_port = port_picker or pick_free_port
        super().__init__(Snapshot(), log, "state listener")
        self._log_listeners: Listeners[[str]] = Listeners(log, "log listener")
        self._log_tail: deque[str] = deque(maxlen=1000)
        self._task: asyncio.Task[None] | None = None
        self._load_output = EngineReportReader()
        # Loads and unloads take turns; `_wanted` counts requests so that only the
        # latest one starts an engine (a load overtaken while it waited never does).
        self._switching = asyncio.Lock()
        self._wanted = 0

    # --- public -------------------------------------------------------------------------

    def add_log_listener(self, listener: LogListener) -> None:
        self._log_listeners.add(listener)

    def log_tail(self, lines: int = 200) -> list[str]:
        return list(self._log_tail)[-lines:]

    async def load(self, spec: LoadSpec) -> Snapshot:
        """Stop whatever runs, start `spec`, and return once it is ready.

        Raises a LoadError subclass when it does not become ready, and LoadSuperseded
        when a later `load` or `unload` came first.  Loads and unloads are serialized
        and the last one asked for wins, so exactly one engine ever runs.  The load
        keeps being supervised (restarted after crashes) until `unload` or the next
        `load`.
        """
        self._wanted += 1
        mine = self._wanted
        async with self._switching:
            if mine != self._wanted:
                raise LoadSuperseded("Another load was asked for before this one started.")
            await self._stop_task()
            if mine != self._wanted:  # asked for while the old engine stopped
                raise LoadSuperseded("Another load was asked for before this one started.")
            ready: asyncio.Future[Snapshot] = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._own(spec, ready), name=f"supervise {spec.name}")
            # A task cancelled before its first step never runs `_own`, so never answers.
            task.add_done_callback(lambda _: _supersede(ready))
            self._task = task
        try:
            return await asyncio.shield(ready)
        except asyncio.CancelledError:
            # Our caller gave up on this load, so nobody wants it any more (unless a
            # later load already replaced it: that one is wanted).
            if self._task is task:
                await self.unload()
            raise

    async def unload(self) -> None:
        self._wanted += 1
        async with self._switching:
            await self._stop_task()

    async def close(self) -> None:
        await self.unload()

    async def _stop_task(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._snapshot.state is not State.STOPPED:
            self._set_state(State.STOPPED, pid=None, restarting=False)

    # --- the task that owns the child ------------------------------------------------------

    async def _own(self, spec: LoadSpec, ready: asyncio.Future[Snapshot]) -> None:
        self._set_state(State.STARTING, model_id=spec.name, model_path=spec.model_path,
                        requested=spec.settings, restarts=0, restarting=False, error=None, pid=None, engine=None,
                        cpu_retry_offered=False)
        restarts: deque[float] = deque()  # when each restart of this load happened
        bind_retries = 0
        child: EngineProcess | None = None
        try:
            while True:
                try:
                    await self._check_rpc_workers(spec)
                except RpcWorkerFailed as exc:
                    if not ready.done():
                        raise
                    if not await self._back_off(restarts, str(exc)):
                        return
                    continue
                port = self._pick_port()
                budget = self.stall_budget()
                known = self._speeds.get((spec, budget))
                child = await self._spawn(spec, port, _batch_args(known))
                try:
                    props = await self._wait_ready(child)
                except EngineExitedDuringLoad as exc:
                    await child.stop(self.stop_timeout)
                    if is_bind_failure(exc.log_tail) and bind_retries < 3:
                        bind_retries += 1
                        log.warning("port %d was taken; retrying on another", port)
                        continue
                    failure = (_rpc_failure(exc, spec, self.log_tail(80))
                               or _gpu_failure(exc, spec, self.log_tail(80)) or exc)
                    if not ready.done():
                        raise failure
                    if not await self._back_off(restarts, str(failure)):
                        return
                    continue
                bind_retries = 0
                if known is None:
                    known = await self._measure(spec, child, props, budget)
                    if known is not None and _batch_args(known):
                        # The batch is fixed at start: this load's first start measures,
                        # a second one runs with the chosen batch (once per load).
                        log.info("restarting llama-server with batch %d: %s",
                                 known.choice.batch, known.choice.reason)
                        await child.stop(self.stop_timeout)
                        continue
                serving = Serving(child.base_url, props.effective_parallel_slots,
                                  context_length=props.context_length,
                                  kv=self._load_output.kv_capacity(props.effective_parallel_slots)
                                  or kv_from_props(props.context_length),
                                  api_key=child.key.value, speed=known,
                                  parks_checkpoints=await _parks_checkpoints(
                                      child, self._slot_dir),
                                  **_prefix_keeping(spec.settings.parallel,
                                                   spec.settings.extra_args))
                self._set_state(State.READY, serving=serving, restarting=False,
                                error=None, pid=child.pid, engine=self._load_output.report())
                if not ready.done():
                    ready.set_result(self._snapshot)
                reason = await self._until_gone(child)
                await child.stop(self.stop_timeout)
                log.warning("%s", reason)
                self._set_state(State.STARTING, pid=None, restarting=True, error=reason)
                if not await self._back_off(restarts, reason):
                    return
        except LoadError as exc:
            await self._stop_child(child)
            self._fail(str(exc), ready, exc, cpu_retry_offered=isinstance(exc, GpuLoadFailed))
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_exception(LoadSuperseded("The load was cancelled before the model was ready."))
            raise
        except Exception as exc:  # a bug, or the OS refusing us: never leave a load half-owned
            log.exception("supervisor failed")
            await self._stop_child(child)
            self._fail(f"Could not start llama-server: {exc}", ready, LoadError(f"Could not start llama-server: {exc}"))
        finally:
            await asyncio.shield(self._stop_child(child))

    async def _check_rpc_workers(self, spec: LoadSpec) -> None:
        """Each of the load's RPC workers answers and can serve this engine (else
        RpcWorkerFailed saying which and why), before an engine is started for them."""
        if spec.settings.rpc:
            await check_rpc_workers(spec.settings.rpc,
                                    await asyncio.to_thread(protocol_of_engine, self.binary))

    async def _measure(self, spec: LoadSpec, child: EngineProcess, props: EngineProps,
                       budget: float) -> EngineSpeed | None:
        """The engine's speed and the batch its stall budget asks for, kept for the next
        start of this load; None for an engine that computes no completions (embeddings)."""
        extra = spec.settings.extra_args
        if any(arg.split("=", 1)[0] in _NO_COMPLETIONS for arg in extra):
            return None
        context = props.context_length or 0
        async with EngineClient(child.base_url, api_key=child.key.value) as engine:
            measured = await measure_speed(engine, context=context)
        model, rate = measured if measured is not None else (None, 0.0)
        choice = choose_batch(model, budget=budget, slots=props.effective_parallel_slots,
                              context=context, extra_args=extra)
        if model is None:
            return None
        speed = EngineSpeed(rate, model.step, model, choice,
                            model.chunk_seconds(choice.batch, max(0, context - choice.batch)))
        log.info("%s", speed.describe())
        self._speeds[(spec, budget)] = speed
        return speed

    async def _stop_child(self, child: EngineProcess | None) -> None:
        if child is None:
            return
        if child.running:
            self._set_state(State.STOPPING)
        await child.stop(self.stop_timeout)

    async def _back_off(self, restarts: deque[float], reason: str) -> bool:
        """Wait before the next restart; False when `max_restarts` already happened within
        the last `restart_window` seconds (state FAILED, saying so)."""
        now = self._clock()
        while restarts and now - restarts[0] > self.restart_window:
            restarts.popleft()
        if len(restarts) >= self.max_restarts:
            self._set_state(State.FAILED, error=(
                f"{reason} Gave up: it had to be restarted {len(restarts)} times within "
                f"{self.restart_window:g} seconds (at most {self.max_restarts}). Load the model "
                "again to retry."), restarting=False, pid=None)
            return False
        restarts.append(now)
        self._set_state(State.STARTING, restarts=self._snapshot.restarts + 1, restarting=True,
                        error=f"{reason} Restarting ({len(restarts)} of at most {self.max_restarts} "
                              f"restarts within {self.restart_window:g} seconds).")
        backoff = self.restart_backoff
        delay = backoff[min(len(restarts) - 1, len(backoff) - 1)] if backoff else 0
        await asyncio.sleep(delay)
        return True

    async def _until_gone(self, child: EngineProcess) -> str:
        """Wait while the ready engine runs and answers; why it no longer does (it exited,
        or it stopped answering /health and was killed)."""
        exited = asyncio.create_task(child.wait())
        watch = asyncio.create_task(self._watch_health(child))
        try:
            await asyncio.wait({exited, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            exited.cancel()
            raise
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        if exited.done():
            return f"llama-server stopped unexpectedly ({describe_exit(exited.result())})."
        child.proc.kill()  # SIGKILL: a hung (or SIGSTOPped) engine would not act on SIGTERM
        await exited
        return (f"llama-server stopped answering (no health answer within "
                f"{self.health_timeout:g} s, {self.health_failures} times in a row); it was killed.")

    async def _watch_health(self, child: EngineProcess) -> None:
        """Returns once the engine failed `health_failures` health checks in a row."""
        failures = 0
        async with EngineClient(child.base_url, api_key=child.key.value) as engine:
            while failures < self.health_failures:
                await asyncio.sleep(self.health_interval)
                healthy = await engine.healthy(timeout=self.health_timeout)
                failures = 0 if healthy else failures + 1
                if not healthy:
                    log.warning("llama-server did not answer its health check (%d of %d)",
                                failures, self.health_failures)

    def _fail(self, message: str, ready: asyncio.Future[Snapshot], exc: Exception,
              cpu_retry_offered: bool = False) -> None:
        self._set_state(State.FAILED, error=message, pid=None, restarting=False,
                        cpu_retry_offered=cpu_retry_offered)
        if not ready.done():
            ready.set_exception(exc)

    async def _spawn(self, spec: LoadSpec, port: int, batch: list[str]) -> EngineProcess:
        log_file = await asyncio.to_thread(
            EngineLogFile.for_start, self.log_dir, spec.name, port,
            max_bytes=self.log_max_bytes, keep_starts=self.log_keep_starts)
        key = EngineKey.create()
        self._slot_dir = await asyncio.to_thread(self.slot_save_dir)
        args = build_command(self.binary, spec, port, api_key_file=key.path,
                             n_predict=self.output_cap(), slot_save_dir=self._slot_dir) + batch
        self._load_output = EngineReportReader()  # this start's report, read from its own output
        try:
            child = await EngineProcess.start(args, port, log_file, self._on_log_line, key)
        except BaseException:
            key.forget()
            await asyncio.to_thread(log_file.close)
            raise
        self._set_state(State.STARTING, pid=child.pid, log_path=str(log_file.path))
        return child

    async def _wait_ready(self, child: EngineProcess) -> EngineProps:
        """What /props says once /health says 200; each way of not getting there has its
        own error."""
        async with EngineClient(child.base_url, api_key=child.key.value, timeout=10.0) as engine:
            return await self._wait_healthy_then_props(child, engine)

    async def _wait_healthy_then_props(self, child: EngineProcess, engine: EngineClient) -> EngineProps:
        deadline = self.load_timeout
        health = asyncio.create_task(engine.wait_healthy())
        exited = asyncio.create_task(child.wait())
        try:
            done, _ = await asyncio.wait({health, exited}, timeout=deadline,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (health, exited):
                if not t.done():
                    t.cancel()
            await asyncio.gather(health, exited, return_exceptions=True)
        if exited in done and not (health in done and not health.cancelled() and health.exception() is None):
            await child.drain_output()
            tail = "\n".join(child.tail(20))
            raise EngineExitedDuringLoad(
                f"llama-server exited while loading the model ({describe_exit(exited.result())}). "
                f"{reason_from_log(child.tail(40))}".strip(), tail)
        if health not in done:
            raise LoadTimedOut(f"The model did not become ready within {self.load_timeout:g} seconds.",
                               "\n".join(child.tail(20)))
        health.result()
        return await engine.props()

    def _on_log_line(self, line: str) -> None:
        self._log_tail.append(line)
        self._load_output.feed(line)
        self._log_listeners(line)

def build_command(binary: Path, spec: LoadSpec, port: int, *,
                  api_key_file: Path | None = None, amx: bool | None = None,
                  n_predict: int = 0, slot_save_dir: Path | None = None) -> list[str]:
    """llama-server's command line: every setting explicit, never the binary's defaults.
    `api_key_file` holds the key the engine's port will require (a file, so that the key
    never shows in the process list); `amx`: does the CPU claim AMX (None: look);
    `n_predict`: the operator's output cap (0: none), the engine's own default limit for
    a request that reaches it without one (the port writes it into every request too);
    `slot_save_dir`: the directory of parked slots (backend.llama.slot_parking)."""
    settings = spec.settings
    parallel = "-1" if settings.parallel == "auto" else str(int(settings.parallel))
    args = [
        str(binary),
        "--model", spec.model_path,
        "--alias", spec.name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", parallel,
        *context_args(settings.ctx_size, fit=settings.n_gpu_layers != NONE),
        *gpu_layer_args(settings.n_gpu_layers),
        *(["--rpc", ",".join(settings.rpc)] if settings.rpc else []),
        "--metrics",
        "--no-webui",
        # llama.cpp prints where the model went (devices, layers offloaded, buffers, the
        # context --fit chose) at trace level only; the engine report reads those lines.
        # It also adds about 30 lines per request to the engine log.
        "--verbosity", "4",
        *(PREFIX_CACHE_ARGS if _port_pins_slots(settings.parallel, settings.extra_args) else ()),
    ]
    if not any(arg.split("=", 1)[0] in CHECKPOINT_FLAGS for arg in settings.extra_args):
        args += ["--ctx-checkpoints", str(CONTEXT_CHECKPOINTS)]
    args += ["--threads", str(settings.threads or default_threads())]
    if n_predict > 0:
        args += ["--n-predict", str(n_predict)]
    if api_key_file is not None:
        args += ["--api-key-file", str(api_key_file)]
    if slot_save_dir is not None:
        args += ["--slot-save-path", str(slot_save_dir)]
    args += chat_template_args(settings.chat_template, model_has_one=spec.own_template)
    if (cpu_claims_amx() if amx is None else amx) and "--no-repack" not in settings.extra_args:
        # Measured on the pinned llama.cpp: where the CPU claims AMX (a cloud VM here),
        # loading a Q4_1 model (SmolLM2) dies with SIGSEGV in ggml's AMX weight layout;
        # without the repacked layouts it loads and answers.  Losing them costs some
        # speed on such CPUs, a crash costs the model.
        args.append("--no-repack")
    args += list(settings.extra_args)
    return args


async def _parks_checkpoints(child: EngineProcess, slot_dir: Path | None) -> bool | None:
    """Does the engine keep a slot's context checkpoints in its save files (our patch)?
    Asked once it is ready by saving its first slot (empty then, or holding the speed
    measurement's prompt) to a file in `slot_dir` removed at once; None when it saves no
    slots here or does not answer."""
    if slot_dir is None:
        return None
    name = f"probe-{secrets.token_hex(8)}.slot"
    try:
        async with SlotClient(child.base_url, api_key=child.key.value) as engine:
            return await engine.parks_checkpoints(0, name)
    except SlotActionFailed as exc:
        log.warning("could not tell whether llama-server saves context checkpoints with a "
                    "slot (%s)", exc)
        return None
    finally:
        await asyncio.to_thread((slot_dir / name).unlink, missing_ok=True)


def _prefix_keeping(parallel: str, extra_args: tuple[str, ...]) -> dict[str, Any]:
    """What a Serving says of an engine started with `PREFIX_CACHE_ARGS`."""
    if not _port_pins_slots(parallel, extra_args):
        return {}
    return {"prefix_note": PREFIX_CACHE_NOTE, "pin_any_slot": True}


def _port_pins_slots(parallel: str, extra_args: tuple[str, ...]) -> bool:
    """Will the port pin every request to a slot, so that the engine may run with
    `PREFIX_CACHE_ARGS`?  Only on a split cache (`-np N`; `-np` left at auto, or
    `--kv-unified`, make one pool, where the port pins nothing), and unless the
    operator's own arguments set the similarity.  Unpinned, a similarity of 1 loses the
    prefix of any conversation the port did not place: measured with SmolLM2 on a
    unified cache, a question after a stopped answer found 0 of 95 prompt tokens
    cached, against 77 with llama-server's own similarity."""
    if str(parallel) == "auto" or "--kv-unified" in extra_args or "-kvu" in extra_args:
        return False
    return "-sps" not in extra_args and "--slot-prompt-similarity" not in extra_args


def default_threads(cores: int | None = None) -> int:
    """Every core but one.  llama-server's own default takes them all, and its worker
    threads spin while they wait, so on a small machine the window and the port starve:
    measured with 2 cores and 64 streams, the window's loop stalled 123 ms at p99 with
    both cores to the engine and 8 ms with one (bench/qt_lag.py), and keep-alives were
    late enough for Codex to give up."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores - 1)


def pick_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


#: Flags of an engine that computes no completions, so has no prompt speed to measure.
_NO_COMPLETIONS = frozenset({"--embedding", "--embeddings", "--reranking", "--rerank"})


def _batch_args(speed: EngineSpeed | None) -> list[str]:
    """The batch flags a start of a measured load gets ([]: the engine's own, or the
    user's in the extra arguments)."""
    if speed is None or speed.choice.user_given:
        return []
    choice = speed.choice
    if (choice.batch, choice.ubatch) == (DEFAULT_BATCH, DEFAULT_UBATCH):
        return []
    return choice.args()


def _supersede(ready: "asyncio.Future[Snapshot]") -> None:
    if not ready.done():
        ready.set_exception(LoadSuperseded("The load was cancelled before the model was ready."))


def _gpu_failure(exc: EngineExitedDuringLoad, spec: LoadSpec,
                 output: list[str]) -> GpuLoadFailed | None:
    """The GPU problem behind a failed start, worded for people, with a CPU retry offered.
    `output` reaches further back than the exception's tail: the allocation error comes
    before the engine's own clean-up lines."""
    if spec.settings.n_gpu_layers == "none" or spec.settings.rpc:
        return None  # GPU layers "none" would keep the layers off the RPC workers too
    reason = gpu_failure_reason(output)
    if reason is None:
        return None
    return GpuLoadFailed(f"{reason} (GPU layers \"none\" loads it on the CPU.)", exc.log_tail)


def _rpc_failure(exc: EngineExitedDuringLoad, spec: LoadSpec,
                 output: list[str]) -> RpcWorkerFailed | None:
    """The RPC problem behind a failed start of a load with workers, worded for people."""
    reason = rpc_failure_reason(output) if spec.settings.rpc else None
    return RpcWorkerFailed(reason, exc.log_tail) if reason else None
