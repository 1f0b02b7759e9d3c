"""An engine that runs elsewhere, watched like one we supervise.

No process to own, but a health watch and snapshots like the supervisor's, so admission
and the gateway cannot tell the difference.  The upstream is a plain llama-server or
another GGUF Studio port; its `/health` says which each time it answers:

- **llama-server** (`{"status": "ok"}`): slots and one slot's context from `/props`
  (each slot's from `/slots` where the engine keeps it on); the KV cache by the layout
  its operator stated (`KvLayout`), since nothing it reports tells split from unified.
  Unstated, it is one shared pool of one slot's context, never more than the engine
  has; with more than one slot that may hold requests back, and the snapshot's
  `kv_note` and the log say so.  Read again every `reread_interval` seconds and each
  time it comes back; a change (slots, context, model, build) gives a new snapshot,
  and the engine is asked what it keeps of a prompt (`backend.llama.prefix_probe`):
  whether a returning session's prefix comes back from its RAM prompt cache
  (`finds_prefix_in_ram`), and which of its flags defeat prefix keeping
  (`prefix_warning`).
- **GGUF Studio** (`/health` with `state`, `effective_parallel_slots`, `kv`, `model`):
  its exact slots and KV cache, read at every health check, and the models it lists
  in `/v1/models` with their context (the list read again every `reread_interval`).
  A port that lists its models in `/health` (every port since the pool) serves each as
  a `ServedModel` of its own: a ready one with its engines' slots and caches there
  together, a loadable one (not loaded there; a request makes it load) with one slot
  until that port reports it ready, any other with none.  Each one's `Serving` has the
  port's address as `base_url` and the model as `upstream_model`, so its admission key
  is its own.  It is in the pool while any model can take a request.  An older port
  (only the top-level fields) is served as its one model.

A failed health check (no answer, or not ready) takes the engine out: its snapshot
leaves READY, so nothing new is sent to it; it comes back by itself once healthy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from pathlib import PurePath
from typing import Any
from urllib.parse import urlsplit

from backend.errors import LoadError, SettingsError
from backend.llama.api import (EngineClient, EngineProps, StudioHealth, StudioModelHealth,
                               UpstreamModel)
from backend.llama.kv_capacity import KvCapacity, KvLayout, assumed_layout_note, kv_from_props
from backend.llama.load import (LogListener, ServedModel, Serving, Snapshot, SnapshotPublisher,
                                State)
from backend.llama.prefix_probe import probe_prefix_keeping

__all__ = ["RemoteEngine", "UpstreamKind", "normalise_base_url"]

log = logging.getLogger("gguf_studio.remote_engine")

#: Seconds between two reads of what an upstream runs (its health is checked every `interval`).
REREAD_INTERVAL = 30.0
#: Requests sent at once for a model another GGUF Studio port can load but has not: the
#: first makes it load; its slots and cache are known once that port says it is ready.
LOADABLE_SLOTS = 1
LOADABLE_NOTE = ("not loaded upstream: one request at a time goes to it (its first loads "
                 "it there) until that port reports its slots and KV cache")


class UpstreamKind(enum.Enum):
    LLAMA_SERVER = "llama-server"
    GGUF_STUDIO = "gguf-studio"


class RemoteEngine(SnapshotPublisher):
    """Watches an engine at `url`; a `LoadBackend` without a process or logs.

    `api_key` is the key that upstream requires; `kv_layout` what its operator states
    about a plain llama-server's cache (None: not stated)."""

    def __init__(self, url: str, *, api_key: str | None = None, kv_layout: KvLayout | None = None,
                 interval: float = 1.0, reread_interval: float = REREAD_INTERVAL) -> None:
        self.base_url = normalise_base_url(url)
        self.api_key = api_key
        self.kv_layout = kv_layout
        self.interval = interval
        self.reread_interval = reread_interval
        #: What answered at `base_url` last; None until something did.
        self.kind: UpstreamKind | None = None
        super().__init__(Snapshot(model_id=None, model_path=None), log, "remote engine listener")
        self._task: asyncio.Task[None] | None = None
        self._next_read = 0.0
        self._read: tuple[Any, ...] | None = None  # what the last read found, to tell a change

    def add_log_listener(self, listener: LogListener) -> None:
        """Nothing to hear: the engine's output stays on the machine that runs it."""

    def log_tail(self, lines: int = 200) -> list[str]:
        return []

    async def start(self) -> Snapshot:
        if self._task is None:
            self._set_state(State.STARTING)
            self._task = asyncio.create_task(self._watch(), name=f"watch {self.base_url}")
        return self._snapshot

    async def unload(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._read = None
        self._set_state(State.STOPPED)

    async def close(self) -> None:
        await self.unload()

    async def _watch(self) -> None:
        async with EngineClient(self.base_url, api_key=self.api_key, timeout=5.0) as engine:
            while True:
                await self._check(engine)
                await asyncio.sleep(self.interval)

    async def _check(self, engine: EngineClient) -> None:
        answer = await engine.health()
        if answer is None:
            self._leave("The upstream does not answer.")
            return
        studio = StudioHealth.read(answer.body)
        if studio is not None:
            self.kind = UpstreamKind.GGUF_STUDIO
            await self._follow_studio(engine, studio)
        elif answer.ok:
            self.kind = UpstreamKind.LLAMA_SERVER
            await self._follow_llama_server(engine)
        else:
            self._leave(f"The upstream is not ready (its health check answers HTTP {answer.status}).")

    async def _follow_llama_server(self, engine: EngineClient) -> None:
        if not self._read_due():
            return
        try:
            props = await engine.props()
        except LoadError as exc:
            self._leave(str(exc))
            return
        contexts = await engine.slot_contexts()
        self._schedule_read()
        slots = props.effective_parallel_slots
        per_slot = min(contexts) if contexts else props.context_length
        kv = kv_from_props(per_slot, slots=slots, layout=self.kv_layout)
        if kv is None:
            self._leave("The upstream llama-server did not report its context size.")
            return
        if self._unchanged(props, contexts):
            return
        note = assumed_layout_note(kv, slots, self.kv_layout)
        if note:
            log.warning("%s: %s", self.base_url, note)
        keeping = await probe_prefix_keeping(engine, slots)
        warning = None if keeping is None else keeping.warning
        if warning:
            log.warning("%s: %s", self.base_url, warning)
        self._serve(model_id=_served_name(props), slots=slots, context_length=per_slot,
                    kv=kv, kv_note=note, upstream_models=(),
                    finds_prefix_in_ram=keeping is not None and keeping.finds_in_ram
                    and keeping.reuses_prompts, prefix_warning=warning)

    async def _follow_studio(self, engine: EngineClient, health: StudioHealth) -> None:
        if health.models is not None:
            await self._follow_studio_models(engine, health, health.models)
            return
        if not health.ready:
            self._leave(f"The upstream GGUF Studio port has no model ready ({health.state}).")
            return
        assert health.slots is not None and health.kv is not None
        models = await self._listed_models(engine, changed=health.model != self._snapshot.model_id)
        if models is None:
            return
        if self._unchanged(health.model, health.slots, health.kv, models):
            return
        self._serve(model_id=health.model or "upstream", slots=health.slots,
                    context_length=health.kv.per_request, kv=health.kv, kv_note=None,
                    upstream_models=models)

    async def _follow_studio_models(self, engine: EngineClient, health: StudioHealth,
                                    listed: tuple[StudioModelHealth, ...]) -> None:
        """A port that lists its models: each one it has ready, or can load, is an engine
        of its own here (see `ServedModel`)."""
        served = tuple(self._served_model(model) for model in listed)
        if not any(model.serving is not None for model in served):
            said = ", ".join(f"{model.name} {model.state}" for model in served) or "none listed"
            self._leave(f"The upstream GGUF Studio port has no model ready or loadable ({said}).",
                        models=served)
            return
        # What it lists (contexts) is read again when a model comes, goes or changes state.
        states = tuple((model.name, model.state) for model in served)
        known = tuple((model.name, model.state) for model in self._snapshot.models)
        models = await self._listed_models(engine, changed=states != known)
        if models is None:
            return
        served = tuple(model if model.serving is None else dataclasses.replace(
            model, serving=dataclasses.replace(model.serving, upstream_models=models))
            for model in served)
        if self._unchanged(health.model, served):
            return
        # The engine's own serving (what one-model views of it show): its default model's,
        # a ready one first.
        first = min((m for m in served if m.serving is not None),
                    key=lambda m: (m.state != State.READY.value, not m.default))
        assert first.serving is not None
        log.info("%s (%s) serves: %s", self.base_url, UpstreamKind.GGUF_STUDIO.value,
                 "; ".join(_describe(model) for model in served))
        self._set_state(State.READY, serving=first.serving, model_id=first.name, models=served,
                        restarting=False, error=None)

    def _served_model(self, model: StudioModelHealth) -> ServedModel:
        slots, kv = model.slots, model.kv
        serving: Serving | None = None
        if slots is not None:
            serving = Serving(self.base_url, slots,
                              context_length=kv.per_request if kv is not None else model.context_length,
                              kv=kv, api_key=self.api_key, upstream_model=model.id,
                              takes_slot_ids=False)
        elif model.loadable:
            serving = Serving(self.base_url, LOADABLE_SLOTS, context_length=model.context_length,
                              api_key=self.api_key, upstream_model=model.id,
                              kv_note=LOADABLE_NOTE, takes_slot_ids=False)
        return ServedModel(model.id, model.state, serving, aliases=model.aliases,
                           context_length=model.context_length, embeddings=model.embeddings,
                           default=model.default, error=model.error,
                           chat_template=model.chat_template)

    async def _listed_models(self, engine: EngineClient, *, changed: bool
                             ) -> tuple[UpstreamModel, ...] | None:
        """What the upstream lists in `/v1/models`, read again when due or `changed`;
        None when it could not be read (the upstream then leaves)."""
        serving = self._snapshot.serving
        models = serving.upstream_models if serving is not None else ()
        if self._read_due() or changed:
            try:
                models = await engine.models()
            except LoadError as exc:
                self._leave(str(exc))
                return None
            self._schedule_read()
        return models

    def _serve(self, *, model_id: str, slots: int, context_length: int | None, kv: KvCapacity,
               kv_note: str | None, upstream_models: tuple[UpstreamModel, ...],
               finds_prefix_in_ram: bool = False, prefix_warning: str | None = None) -> None:
        if self._snapshot.state is not State.READY:
            log.info("%s (%s) joins: %s, %s", self.base_url, self.kind.value if self.kind else "?",
                     model_id, kv.describe(slots))
        else:
            log.info("%s changed: %s, %s", self.base_url, model_id, kv.describe(slots))
        serving = Serving(self.base_url, slots, context_length=context_length, kv=kv,
                          api_key=self.api_key, kv_note=kv_note, upstream_models=upstream_models,
                          takes_slot_ids=self.kind is not UpstreamKind.GGUF_STUDIO,
                          finds_prefix_in_ram=finds_prefix_in_ram, prefix_warning=prefix_warning)
        self._set_state(State.READY, serving=serving, model_id=model_id, models=(),
                        restarting=False, error=None)

    def _leave(self, error: str, *, models: tuple[ServedModel, ...] | None = None) -> None:
        """Out of the pool until the upstream is healthy again, when it is read anew.
        `models`: what it lists now (else its models stay as last read)."""
        self._next_read, self._read = 0.0, None
        changes: dict[str, Any] = {} if models is None else {"models": models}
        if self._snapshot.state is State.READY:
            log.warning("%s leaves: %s", self.base_url, error)
            self._set_state(State.STARTING, restarting=True, error=error, **changes)
        elif self._snapshot.error != error or (models is not None and models != self._snapshot.models):
            log.info("%s: %s", self.base_url, error)
            self._set_state(self._snapshot.state, error=error, **changes)

    def _read_due(self) -> bool:
        return self._snapshot.state is not State.READY or \
            asyncio.get_running_loop().time() >= self._next_read

    def _schedule_read(self) -> None:
        self._next_read = asyncio.get_running_loop().time() + self.reread_interval

    def _unchanged(self, *read: Any) -> bool:
        """Whether the upstream still runs what it ran at the last read (a restart with
        other settings, another model or another build is a change)."""
        unchanged = self._snapshot.state is State.READY and self._read == read
        self._read = read
        return unchanged


def _describe(model: ServedModel) -> str:
    serving = model.serving
    if serving is None:
        return f"{model.name} {model.state}"
    if serving.kv is None:
        return f"{model.name} {model.state} ({serving.slots} slot{'s' if serving.slots != 1 else ''})"
    return f"{model.name} {model.state} ({serving.kv.describe(serving.slots)})"


def _served_name(props: EngineProps) -> str:
    """The name clients see: llama-server's alias, whose default is the model's path on
    its machine, which is cut to the file's name (paths are never shown)."""
    alias = props.model_alias or ""
    if not alias or alias == props.model_path or "/" in alias or "\\" in alias:
        name = PurePath(alias.replace("\\", "/")).name.removesuffix(".gguf")
        return name or "upstream"
    return alias


def normalise_base_url(url: str) -> str:
    """'http://host:8080/v1/' -> 'http://host:8080'."""
    parts = urlsplit(url.strip())
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise SettingsError(f"The upstream must be an http(s) URL like http://host:8080, not {url!r}.")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"
