"""The models this port runs itself: each GGUF file's engine, loaded, kept and unloaded.

A local model (a `ModelEntry`) is run by its own `Supervisor`: its own llama-server, key,
report, restarts, logs, slots and KV.  `LocalModels` keeps their state (`LocalModel`) and
decides their residency; the pool (`backend.app.pool.pool`) routes requests to them and to
engines elsewhere.  Residency follows the fit estimate (`backend.models.fit`):

- a request for a known model that is not loaded loads it (it waits meanwhile, with
  keep-alives; its queue timeout counts);
- before a load, the model's estimated memory must fit beside the loaded ones within
  the budget (the machine's usable RAM and VRAM, or `memory_limit_mib`); if it does
  not, the least recently used unpinned model that nobody uses is unloaded first —
  drained, never killed with a request on it; if every other model is busy, the load
  waits for one to become idle, taking no room meanwhile (loads that fit go ahead);
- a load for a lower priority band (the highest band among the requests it is for)
  does not evict a model a higher band used within `BAND_PROTECTION` seconds: it waits;
- a model idle for its `idle_ttl` is unloaded;
- a failed model (its load failed, or its engine crashed past its restarts) refuses
  requests for `FAILED_COOL_DOWN` seconds, then loads again on demand; each crash is
  counted against the named keys whose requests were in flight, and a key in flight at
  more than one crash is named in the model's decision.

Each decision, with its reason, is kept on the model (`ModelStatus.decision`), logged,
and shown by the window and `/health`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path

from backend.memory_size import format_memory
from backend.errors import (RETRY_SOON, LoadError, LoadReplaced, ModelFileError, ModelNotFound,
                            ModelNotReady, RequestError)
from backend.listeners import Listeners
from backend.llama.chat_template import ChatTemplate
from backend.llama.load import Serving, Snapshot, State
from backend.llama.supervisor import Supervisor
from backend.models.fit import RAM_USABLE, estimate_fit, load_memory, machine_memory
from backend.models.gguf_info import read_model_info
from backend.admission.caller import ADDRESS_FLOW
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.line import Line
from backend.admission.admission_registry import AdmissionRegistry
from backend.admission.flow import Band
from backend.app.pool.pool_config import ModelEntry
from backend.app.pool.pool_status import HERE, Residency
from backend.settings import Settings

__all__ = ["LocalModel", "LocalModels", "estimate_model_bytes", "memory_budget"]

log = logging.getLogger("gguf_studio.pool")

#: How often idle models are looked at for their idle TTL (at most).
IDLE_CHECK_INTERVAL = 1.0
#: How long requests ended by an unload get to close their engine connections.
ABORT_WAIT = 5.0
#: How long a model used by a higher priority band is kept from being evicted for a
#: lower band's load: a few turns of a person at a chat or an agent between requests.
BAND_PROTECTION = 120.0
#: How long a failed model (its load failed, or its engine crashed past its restarts)
#: refuses requests before one loads it again: a crash loop costs at most one round of
#: restarts per cool-down instead of a load per request, and a passing cause (memory
#: taken by another program, a driver reset) no longer leaves it failed until the owner
#: loads it by hand.
FAILED_COOL_DOWN = 60.0
#: How often a load waiting for room looks again, whatever woke it or not.
ROOM_RECHECK = 1.0
#: A request dropped by an engine this long before its crash was noticed was hit by it.
CRASH_WINDOW = 2.0


class LocalModels:
    """The local models by name, and their loads, evictions, idleness and crashes."""

    def __init__(self, registry: AdmissionRegistry, *, settings: Callable[[], Settings],
                 engine_binary: Callable[[], Awaitable[Path]],
                 new_supervisor: Callable[[Path], Supervisor],
                 abort: Callable[[str, RequestError], int],
                 memory_budget: Callable[[], int],
                 estimate: Callable[[ModelEntry], int],
                 before_loss: Callable[[str, Serving], Awaitable[object]] | None,
                 clock: Callable[[], float], told: Listeners[[str, Snapshot]],
                 logs: Listeners[[str, str]], changed: Listeners[[]]) -> None:
        self.registry = registry
        #: By name, in the order they were added; the pool's catalogue reads it.
        self.models: dict[str, LocalModel] = {}
        self.memory_limit_mib = 0
        #: Called with a drained engine just before a planned stop (its sessions' slots
        #: are parked: backend.app.pool.parking_steward); it bounds its own time.
        self._before_loss = before_loss
        self._settings = settings
        self._engine_binary = engine_binary
        self._new_supervisor = new_supervisor
        self._abort = abort
        self._memory_budget = memory_budget
        self._estimate = estimate
        self._clock = clock
        self._told = told
        self._logs = logs
        self._changed = changed
        self._residency_lock = asyncio.Lock()
        self._idle_task: asyncio.Task[None] | None = None

    def add(self, entry: ModelEntry) -> None:
        """Know `entry` (replacing an entry of the same name, which keeps its state)."""
        local = self.models.get(entry.name)
        if local is None:
            self.models[entry.name] = LocalModel(entry)
        else:
            local.entry = entry
            local.estimate = None
        self._ensure_idle_watch()

    def serve(self, local: LocalModel, band: Band) -> None:
        """Make sure `local` will be served: not loaded, it starts loading (for `band`,
        which decides what its load may evict); failed, it answers ModelNotReady until
        its cool-down is over, then loads again."""
        name = local.entry.name
        now = self._clock()
        local.last_used = local.used_by[band] = now
        if local.residency is Residency.FAILED and not self.registry.busy(name):
            wait = (local.failed_at or now) + FAILED_COOL_DOWN - now
            if wait > 0:
                raise ModelNotReady(
                    f"The model {name} failed. {local.error or ''}".strip()
                    + f" It loads again on demand in {math.ceil(wait)} s.",
                    retry_after=float(max(1, math.ceil(wait))))
        if local.loading is not None:
            local.load_band = min(local.load_band, band)
        elif not local.resident:
            why = ("loaded on demand after the cool-down of its failure"
                   if local.residency is Residency.FAILED else "loaded on demand")
            self._start_loading(local, why=why, band=band)

    def set_model_options(self, name: str, *, pinned: bool | None = None,
                          idle_ttl: float | None = None) -> None:
        """Pin or unpin a local model, or change its idle TTL (seconds, 0: never), now.
        Pinning drops the idle TTL: a pinned model is never unloaded for idleness."""
        local = self._local(name)
        changes: dict[str, object] = {}
        if pinned is not None:
            changes["pinned"] = bool(pinned)
            if pinned and idle_ttl is None:
                changes["idle_ttl"] = 0.0
        if idle_ttl is not None:
            if idle_ttl < 0:
                raise ValueError("An idle TTL is 0 (never) or a number of seconds.")
            changes["idle_ttl"] = float(idle_ttl)
            local.last_used = max(local.last_used, self._clock())  # counted from now
        local.entry = dataclasses.replace(local.entry, **changes)  # type: ignore[arg-type]
        self._ensure_idle_watch()
        self._changed()

    async def remove_model(self, name: str) -> None:
        await self.unload_model(name, reason="removed")
        self.models.pop(name, None)
        self._changed()

    async def start(self) -> None:
        """Load every model marked to load at start (one after the other)."""
        for local in list(self.models.values()):
            if local.entry.preload and not local.resident:
                try:
                    await self.load_model(local.entry.name, why="loaded at start")
                except LoadError as error:
                    log.error("%s did not load: %s", local.entry.name, error)

    async def load_model(self, name: str, *, why: str = "loaded on request") -> Snapshot:
        """Load `name` (making room first if needed) and return its ready snapshot.
        Raises LoadError when it does not load."""
        local = self._local(name)
        if local.loading is None:
            self._start_loading(local, why=why)
        assert local.loading is not None
        return await asyncio.shield(local.loading)

    async def unload_model(self, name: str, *, reason: str = "unloaded on request",
                           refuse: bool = True, evicted: bool = False) -> None:
        """Stop serving `name`: nothing new goes to it, requests running on it get the
        reload grace to finish (then end with a clean error), then its engine stops.
        `refuse`: its waiters are told it is gone (else they wait for its next load)."""
        local = self.models.get(name)
        if local is None or local.supervisor is None:
            return
        if local.loading is not None and not local.loading.done():
            local.loading.cancel()
        local.residency = Residency.UNLOADING
        self._decide(local, reason)
        queue = self.registry.current_of(local.engine_id)
        self.registry.retire(local.engine_id)
        ended = False  # requests were ended by the unload
        if queue is not None:
            grace = self._settings().reload_grace
            if queue.active and grace > 0:
                await self._drained(lambda: queue.active == 0, grace)
            ended = queue.active > 0
            if queue.active:
                log.warning("%d request(s) still running on %s; ending them", queue.active, name)
                self._abort(queue.key, LoadReplaced(
                    "The model was replaced or unloaded while this request ran. Send it again."))
                # Their connections to the engine close as they end: llama-server stops
                # on SIGTERM at once then, instead of finishing each generation first.
                await self._drained(lambda: queue.active == 0, ABORT_WAIT)
        serving = local.supervisor.snapshot.serving
        # Parked only when drained: a slot still generating would hold its save back.
        if self._before_loss is not None and serving is not None and (
                queue is None or queue.active == 0) and not ended:
            try:
                await self._before_loss(name, serving)
            except Exception:  # a failed save must never keep an engine from stopping
                log.exception("%s: parking its sessions failed", name)
        await local.supervisor.unload()
        local.residency = Residency.EVICTED if evicted else Residency.UNLOADED
        local.room = False
        local.loading = None
        if refuse:
            self.registry.refuse_waiting(
                ModelNotReady(f"The model {name} was unloaded.", retry_after=RETRY_SOON), name)
        self._changed()

    async def unload_all(self) -> None:
        for name in list(self.models):
            await self.unload_model(name)

    async def close(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
            await asyncio.gather(self._idle_task, return_exceptions=True)
            self._idle_task = None
        await self.unload_all()

    # --- loading and residency ----------------------------------------------------------

    def _start_loading(self, local: LocalModel, *, why: str, band: Band = Band.INTERACTIVE) -> None:
        local.residency = Residency.LOADING
        local.room = False
        local.load_band = band
        local.error = None
        local.loading = asyncio.ensure_future(self._load(local, why))
        local.loading.add_done_callback(self._loaded)
        self._changed()

    def _loaded(self, task: asyncio.Task[Snapshot]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved here; awaiting callers re-raise it themselves

    async def _load(self, local: LocalModel, why: str) -> Snapshot:
        name = local.entry.name
        try:
            await self._make_room(local, why)
            binary = await self._engine_binary()
            supervisor = local.supervisor
            if supervisor is not None and supervisor.binary != binary:
                await supervisor.close()  # another engine was built or chosen meanwhile
                supervisor = local.supervisor = None
            if supervisor is None:
                supervisor = local.supervisor = self._new_supervisor(binary)
                supervisor.add_listener(lambda snapshot: self._on_local_snapshot(local, snapshot))
                supervisor.add_log_listener(lambda line: self._logs(name, line))
            spec = local.entry.to_spec(own_template=local.own_template)
            snapshot = await supervisor.load(spec)
            template = local.chat_template
            if template is not None and not template.takes_chats:
                log.warning("%s: %s", name, template.warning())
            local.residency = Residency.READY
            local.failed_at = None
            local.last_used = self._clock()
            self._changed()
            return snapshot
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            local.residency = Residency.FAILED
            local.room = False
            local.failed_at = self._clock()
            local.error = str(error)
            self._decide(local, f"failed to load: {error} (loads again on demand after "
                                f"{FAILED_COOL_DOWN:g} s)")
            self.registry.refuse_waiting(
                ModelNotReady(f"The model {name} failed to load.", retry_after=RETRY_SOON), name)
            raise
        finally:
            if local.loading is asyncio.current_task():
                local.loading = None

    async def _make_room(self, local: LocalModel, why: str) -> None:
        """Unload least recently used idle models until `local` fits the budget; wait
        while the only candidates are busy, or kept for a higher band (see
        `_kept_for`); fail when pinned models leave no room.  A load that waits holds
        no lock and takes no room meanwhile: loads that fit go ahead."""
        name = local.entry.name
        while True:
            async with self._residency_lock:
                need = await self._estimate_of(local)
                budget = self._budget()
                placed = [m for m in self.models.values() if m is not local and m.holds_room]
                used = sum([await self._estimate_of(m) for m in placed])
                if budget <= 0 or used + need <= budget:
                    local.room = True
                    beside = f" beside {_names(placed)}" if placed else ""
                    self._decide(local, f"{why}: needs about {_gib(need)}, fits{beside} "
                                        f"({_gib(used + need)} of {_gib(budget)})")
                    return
                now = self._clock()
                idle = [m for m in placed if not m.entry.pinned
                        and m.residency is Residency.READY and not self.registry.busy(m.entry.name)]
                kept = {id(m): self._kept_for(m, local.load_band, now) for m in idle}
                free = sorted((m for m in idle if kept[id(m)] is None), key=lambda m: m.last_used)
                if free:
                    victim = free[0]
                    reason = (f"evicted to make room for {name} (least recently used; "
                              f"{_gib(used + need)} would pass the {_gib(budget)} budget)")
                    log.info("%s %s", victim.entry.name, reason)
                    await self.unload_model(victim.entry.name, reason=reason, refuse=False,
                                            evicted=True)
                    continue
                others = [m for m in placed if not m.entry.pinned]
                if not others:
                    raise LoadError(
                        f"{name} needs about {_gib(need)} but only {_gib(max(0, budget - used))} "
                        f"of the {_gib(budget)} budget is left beside the pinned models "
                        f"({_names(placed)}). Unload one or raise the memory limit.")
                waits = [k for k in kept.values() if k is not None]
                busy = [m for m in others if self.registry.busy(m.entry.name)]
                reasons = []
                if busy:
                    reasons.append(f"{_names(busy)} still serve requests")
                for model, band, _until in waits:
                    reasons.append(f"{model} is kept for its {band.name.lower()} requests "
                                   f"(this load is for {local.load_band.name.lower()} ones)")
                decision = "waiting for room: " + "; ".join(reasons or ["others load or unload"])
                if local.decision != decision:
                    self._decide(local, decision)
                wake = min([ROOM_RECHECK, *(until - now for _m, _b, until in waits)])
                watched = busy
            # Woken when a busy one goes idle; looked at again every ROOM_RECHECK anyway
            # (a protection that lapses, a model that unloads or finishes loading).
            await self._drained(lambda: any(not self.registry.busy(m.entry.name)
                                            for m in watched), timeout=max(0.0, wake))

    def _kept_for(self, model: LocalModel, band: Band, now: float) -> tuple[str, Band, float] | None:
        """Whether a load for `band` may not evict `model`: a higher band used it within
        BAND_PROTECTION seconds.  (model, that band, when it may be evicted) or None."""
        for higher in sorted(model.used_by):
            if higher >= band:
                break
            until = model.used_by[higher] + BAND_PROTECTION
            if until > now:
                return model.entry.name, higher, until
        return None

    async def _estimate_of(self, local: LocalModel) -> int:
        if local.estimate is None:
            local.estimate = await asyncio.to_thread(self._estimate, local.entry)
        return local.estimate

    def _budget(self) -> int:
        if self.memory_limit_mib > 0:
            return self.memory_limit_mib * 1024 * 1024
        return self._memory_budget()

    # --- idleness ---------------------------------------------------------------------------

    def _ensure_idle_watch(self) -> None:
        if self._idle_task is None and any(m.entry.idle_ttl > 0 for m in self.models.values()):
            try:
                self._idle_task = asyncio.get_running_loop().create_task(
                    self._watch_idle(), name="idle models")
            except RuntimeError:  # no loop yet: started with the first load
                pass

    async def _watch_idle(self) -> None:
        while True:
            ttls = [m.entry.idle_ttl for m in self.models.values() if m.entry.idle_ttl > 0]
            await asyncio.sleep(min([IDLE_CHECK_INTERVAL, *(t / 4 for t in ttls)]))
            now = self._clock()
            for local in list(self.models.values()):
                name = local.entry.name
                ttl = local.entry.idle_ttl
                if ttl <= 0 or local.entry.pinned or local.residency is not Residency.READY:
                    continue
                if local.loading is not None and not local.loading.done():
                    continue  # ready but its load not yet returned: unloading would cancel it
                if self.registry.busy(name):
                    local.last_used = now
                elif now - local.last_used >= ttl:
                    reason = f"idle for {ttl:g} s: unloaded"
                    log.info("%s %s", name, reason)
                    await self.unload_model(name, reason=reason, refuse=False, evicted=True)

    # --- engines' snapshots ----------------------------------------------------------------

    def _on_local_snapshot(self, local: LocalModel, snapshot: Snapshot) -> None:
        name = local.entry.name
        if snapshot.serving is not None:
            self.registry.activate(snapshot.serving, model=name, engine=local.engine_id,
                                   label=HERE)
            if local.residency is Residency.LOADING:
                local.residency = Residency.READY
                local.last_used = self._clock()  # its idle time starts now, not at its last use
        else:
            if self.registry.current_of(local.engine_id) is not None:
                line = self.registry.find_line(name)  # before retiring may forget it
                self.registry.retire(local.engine_id)  # a crash or a stop: nothing new goes to it
                if local.residency is not Residency.UNLOADING and (
                        snapshot.restarting or snapshot.state is State.FAILED):
                    self._crashed(local, line)
            # Also after a crash retired it: the restarts it then gave up on fail it.
            if snapshot.state is State.FAILED and local.residency in (Residency.READY,
                                                                      Residency.LOADING):
                local.residency = Residency.FAILED
                local.room = False
                local.failed_at = self._clock()
                local.error = snapshot.error
                self._decide(local, f"failed: {snapshot.error or 'its engine stopped'} (loads "
                                    f"again on demand after {FAILED_COOL_DOWN:g} s)"
                                    + self._suspects(local))
                self.registry.refuse_waiting(
                    ModelNotReady("The model stopped working.", retry_after=RETRY_SOON), name)
        self._told(name, snapshot)

    def _crashed(self, local: LocalModel, line: Line[AdmissionQueue] | None) -> None:
        """Its engine died under requests (`line`: its model's, as it was): count the
        crash against the named keys whose requests were in flight, and say so when one
        was there more than once."""
        flows = line.flows_in_flight(CRASH_WINDOW) if line is not None else set()
        local.crashes += 1
        local.crashed_with.update(flow for flow in flows
                                  if flow and not flow.startswith(ADDRESS_FLOW))
        log.warning("%s: its engine crashed (%d since it was added) with requests of %s "
                    "in flight", local.entry.name, local.crashes,
                    ", ".join(sorted(repr(f) for f in flows)) or "nobody")
        suspects = self._suspects(local)
        if suspects:
            self._decide(local, f"its engine crashed ({local.crashes} times)" + suspects)

    def _suspects(self, local: LocalModel) -> str:
        """The named keys in flight at more than one of its crashes, most first."""
        repeated = [(n, key) for key, n in local.crashed_with.most_common(3) if n > 1]
        if not repeated:
            return ""
        return "; requests of " + ", ".join(f"key {key!r} were in flight at {n}"
                                             for n, key in repeated) + " of its crashes"

    # --- helpers ---------------------------------------------------------------------

    def _local(self, name: str) -> LocalModel:
        local = self.models.get(name)
        if local is None:
            raise ModelNotFound(f"The model {name!r} is not in the pool.")
        return local

    def _decide(self, local: LocalModel, decision: str) -> None:
        local.decision = decision
        log.info("%s: %s", local.entry.name, decision)
        self._changed()

    async def _drained(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Wait until `done()` holds (checked on every admission change)."""
        if done():
            return
        changed = asyncio.Event()
        listener = changed.set
        self.registry.add_listener(listener)
        try:
            async with asyncio.timeout(timeout):
                while not done():
                    changed.clear()
                    await changed.wait()
        except TimeoutError:
            pass
        finally:
            self.registry.remove_listener(listener)


class LocalModel:
    """A local model's runtime state."""

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.supervisor: Supervisor | None = None
        self.residency = Residency.UNLOADED
        self.decision = "not loaded yet" if not entry.preload else "loading at start"
        self.error: str | None = None
        self.last_used = 0.0
        self.loading: asyncio.Task[Snapshot] | None = None
        self.estimate: int | None = None  # bytes, once worked out
        #: Its load has been given room in the budget (a load still waiting for room
        #: takes none, so loads that fit go ahead of it).
        self.room = False
        #: The highest band (the smallest) of the requests its current load is for.
        self.load_band = Band.INTERACTIVE
        #: When each band last sent it a request.
        self.used_by: dict[Band, float] = {}
        self.failed_at: float | None = None
        #: Crashes of its engine, and how many of them each named key was in flight at.
        self.crashes = 0
        self.crashed_with: collections.Counter[str] = collections.Counter()
        #: (the file read, whether it carries a chat template of its own)
        self._own_template: tuple[str, bool] | None = None

    @property
    def engine_id(self) -> str:
        return f"local:{self.entry.name}"

    @property
    def resident(self) -> bool:
        return self.residency in (Residency.LOADING, Residency.READY, Residency.UNLOADING)

    @property
    def own_template(self) -> bool:
        """Whether its file carries a chat template of its own (read once per file: a
        header read, some milliseconds; an unreadable file counts as having one, its load
        says what is wrong with it)."""
        path = self.entry.path
        if self._own_template is None or self._own_template[0] != path:
            try:
                has_one = read_model_info(path).has_chat_template
            except ModelFileError:
                has_one = True
            self._own_template = (path, has_one)
        return self._own_template[1]

    @property
    def chat_template(self) -> ChatTemplate | None:
        """What its chats are rendered with; None for an embeddings model (no chats)."""
        if self.entry.embeddings:
            return None
        return ChatTemplate.of(self.entry.settings.chat_template, model_has_one=self.own_template)

    @property
    def holds_room(self) -> bool:
        """It counts in the memory budget: loaded, or loading with room given."""
        return self.residency in (Residency.READY, Residency.UNLOADING) or (
            self.residency is Residency.LOADING and self.room)


def memory_budget() -> int:
    """What local models may take together: the usable part of this machine's RAM.
    (GPU memory is not added: a model that runs on a GPU also maps its file in RAM.)"""
    return int(machine_memory().ram_bytes * RAM_USABLE)


def estimate_model_bytes(entry: ModelEntry) -> int:
    """The fit estimate of `entry` as its engine is started (weights, the KV cache and
    state of its context and slots, working space)."""
    info = read_model_info(entry.path)
    memory = load_memory(info, entry.settings)
    return estimate_fit(info.file_size, machine_memory(), context=entry.settings.ctx_size, info=info,
                        cache=memory.settings if memory is not None else None).total_bytes


def _gib(n: int) -> str:
    return format_memory(n)


def _names(models: list[LocalModel]) -> str:
    return ", ".join(m.entry.name for m in models) or "nothing"

