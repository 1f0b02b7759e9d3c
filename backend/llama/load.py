"""What a load is: the settings a user asks for, the spec the engine gets, the state it is in.

The contract between whatever runs llama-server (the local `Supervisor`, or a
`RemoteEngine` that watches one running elsewhere) and everything that uses it
(service, admission, gateway, metrics, the window).  `LoadSettings` is the one shape
load parameters are kept in: the model library, the window and `Settings` all convert
to and from it, and `LoadSpec` is built from it in one place (`LoadSettings.to_spec`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from backend.llama.api import UpstreamModel
from backend.llama.chat_template import ChatTemplate, check_chat_template, normal_chat_template
from backend.llama.engine_speed import EngineSpeed
from backend.llama.report import EngineReport
from backend.errors import SettingsError
from backend.llama.kv_capacity import KvCapacity, planned_capacity
from backend.listeners import Listeners
from backend.settings import Settings
from backend.gpu_layers import NONE, parse_gpu_layers, read_saved_gpu_layers
from backend.rpc_workers import parse_rpc_workers

# Flags GGUF Studio owns; a user's extra arguments may not override them.  Every
# spelling the pinned llama.cpp accepts (common/arg.cpp; tests check them against it):
# llama.cpp reads `--api_key` as `--api-key`, and we also refuse `--flag=value`.
OWNED_FLAGS = frozenset({
    "-m", "--model", "--host", "--port", "-np", "--parallel", "--api-key",
    "--api-key-file", "-a", "--alias", "-mu", "--model-url", "-hf", "-hfr", "--hf-repo",
    # The RPC workers setting: checked for reachability before the engine starts, and
    # its failures worded for people (backend.llama.rpc_worker).
    "--rpc",
    # The output cap: the port reserves and writes it (backend.port.request_body).
    "-n", "--predict", "--n-predict",
    # Parked slots live in a private directory GGUF Studio owns (backend.llama.slot_parking).
    "--slot-save-path",
    # The chat template: the port refuses chats for a model without one, so it must know
    # the one the engine renders with (LoadSettings.chat_template, backend.llama.chat_template).
    "--chat-template", "--chat-template-file",
})

# What threads 0 (the default) means, for every help text that mentions it.
THREADS_HELP = "every core but one, so the window and the port stay responsive"


class State(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


@dataclass(frozen=True)
class LoadSettings:
    """How the user wants one model loaded; saved per model and as the last load."""

    ctx_size: int = 0  # 0: the model's trained context
    parallel: str = "auto"  # "auto" or a positive integer
    n_gpu_layers: str = "auto"  # "auto", "all", "none" or a number (backend/gpu_layers.py)
    threads: int = 0  # 0: every core but one (THREADS_HELP)
    extra_args: tuple[str, ...] = ()
    #: Machines running `gguf-studio rpc-worker` ("host:port") the model is spread over.
    rpc: tuple[str, ...] = ()
    #: The chat template the owner picked: "" the model's own, a llama.cpp built-in's
    #: name, a Jinja file, or "none" (backend.llama.chat_template).
    chat_template: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_gpu_layers", parse_gpu_layers(self.n_gpu_layers))
        object.__setattr__(self, "chat_template", normal_chat_template(self.chat_template))
        try:
            object.__setattr__(self, "rpc", parse_rpc_workers(self.rpc))
        except SettingsError:  # kept as given: `validate` (every load) says what is wrong
            object.__setattr__(self, "rpc", tuple(str(w) for w in self.rpc))

    def validate(self) -> None:
        """Raises SettingsError for an unusable value or a flag GGUF Studio owns."""
        parallel = str(self.parallel)
        if parallel != "auto" and not (parallel.isdigit() and int(parallel) > 0):
            raise SettingsError(f"Parallel slots must be 'auto' or a positive number, not {self.parallel!r}.")
        owned = sorted({flag for flag in map(_flag_name, self.extra_args) if flag in OWNED_FLAGS})
        if owned:
            raise SettingsError(
                f"{', '.join(owned)} cannot be given as extra arguments: GGUF Studio sets "
                "the model, host, port, parallel slots, API key, RPC workers, output cap and "
                "chat template itself (the chat template is a load setting of its own).")
        parse_rpc_workers(self.rpc)
        check_chat_template(self.chat_template)
        if self.rpc and self.n_gpu_layers == NONE:
            raise SettingsError(
                "RPC workers take the model's layers as devices, and GPU layers \"none\" "
                "keeps every layer on this machine: use auto or all with RPC workers.")

    def to_spec(self, model_path: str, *, own_template: bool = True, model_id: str = "") -> "LoadSpec":
        """The one way a load is built; `own_template`: whether the GGUF file carries a
        chat template of its own.  Raises SettingsError like `validate`."""
        settings = dataclasses.replace(self, parallel=str(self.parallel).strip() or "auto",
                                       extra_args=tuple(self.extra_args))
        return LoadSpec(model_path=str(model_path), settings=settings,
                        own_template=own_template, model_id=model_id)

    def describe_plan(self, trained_context: int | None) -> str:
        """What these settings mean for clients, before loading ("Up to 4 requests at
        once; each slot has its own 8,192 tokens."), for a model trained on
        `trained_context` tokens, by llama-server's own rules (`planned_capacity`)."""
        try:
            plan = planned_capacity(self.ctx_size, str(self.parallel), trained_context,
                                    tuple(self.extra_args), fit=self.n_gpu_layers != NONE)
        except ValueError:
            plan = None
        if plan is None:
            return "The engine decides the context; it is shown after loading."
        return plan.describe()

    @classmethod
    def last_load(cls, settings: Settings) -> "LoadSettings":
        """The last load's settings, as `Settings` remembers them."""
        return cls(ctx_size=settings.ctx_size, parallel=settings.parallel,
                   n_gpu_layers=settings.n_gpu_layers, threads=settings.threads,
                   extra_args=tuple(settings.extra_args), rpc=tuple(settings.rpc),
                   chat_template=settings.chat_template)

    def remembered_in(self, settings: Settings) -> Settings:
        """A copy of `settings` remembering these as the last load's settings, but for
        the chat template: it belongs to one model (the library keeps it with it), and
        remembered here it would render the next `serve --model` of another model with
        it instead of that model's own.  Only `serve --chat-template` (with `--save`, or
        its variable) sets the settings' one."""
        return settings.replace(ctx_size=self.ctx_size, parallel=str(self.parallel),
                                n_gpu_layers=self.n_gpu_layers, threads=self.threads,
                                extra_args=list(self.extra_args), rpc=list(self.rpc))

    @staticmethod
    def parse_extra_args(text: str) -> tuple[str, ...]:
        try:
            return tuple(shlex.split(text))
        except ValueError as exc:
            raise SettingsError(f"The extra arguments cannot be read: {exc}.") from None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["extra_args"] = list(self.extra_args)
        data["rpc"] = list(self.rpc)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LoadSettings":
        def number(key: str) -> int:
            try:
                return max(0, int(data.get(key, 0)))
            except (TypeError, ValueError):
                return 0

        def strings(key: str) -> tuple[str, ...]:
            value = data.get(key) or ()
            if key == "rpc" and isinstance(value, str):  # "a:50052,b:50052", as typed
                return tuple(value.replace(",", " ").split())
            return tuple(str(a) for a in value) if isinstance(value, (list, tuple)) else ()

        # Workers are kept as saved, even unusable ones: the load then says what is wrong
        # with them instead of quietly loading the model on this machine alone.
        return cls(ctx_size=number("ctx_size"), parallel=str(data.get("parallel") or "auto"),
                   n_gpu_layers=read_saved_gpu_layers(data.get("n_gpu_layers", "auto")),
                   threads=number("threads"), extra_args=strings("extra_args"),
                   rpc=strings("rpc"), chat_template=str(data.get("chat_template") or ""))


@dataclass(frozen=True)
class LoadSpec:
    """Everything that defines one load; replaying it after a crash gives the same load."""

    model_path: str
    settings: LoadSettings = LoadSettings()
    own_template: bool = True  #: the GGUF file carries a chat template of its own
    model_id: str = ""  # the name clients see; the file name without .gguf by default

    def __post_init__(self) -> None:
        self.settings.validate()

    @property
    def name(self) -> str:
        return self.model_id or Path(self.model_path).name.removesuffix(".gguf")

    @property
    def chat_template(self) -> ChatTemplate:
        """What the engine renders chats with (none: the port refuses chat routes)."""
        return ChatTemplate.of(self.settings.chat_template, model_has_one=self.own_template)


@dataclass(frozen=True, slots=True)
class Serving:
    """An engine that serves: where it listens, its key, and what it holds.

    Exists exactly while an engine serves (a `Snapshot` in state READY has one, any other
    has None), so "not serving" is one `None`, never a set of cleared fields.  Admission
    keeps one queue per `key`; a new process of the same load has a new port, hence a new
    key and a new queue.
    """

    base_url: str
    slots: int  #: the effective parallel slots, as the engine reported them
    context_length: int | None = None  #: one request's limit (the per-slot context)
    kv: KvCapacity | None = None  #: the engine's KV cache; None while unknown
    #: What the engine's own port requires (a random key per start of a managed engine,
    #: so no other local process can use it around the gateway's key and queue).
    api_key: str | None = dataclasses.field(default=None, repr=False)
    #: The model this engine is, when it is one of several another GGUF Studio port
    #: serves (requests go there naming it); part of the admission `key`.
    upstream_model: str | None = None
    #: Set when the KV cache is an assumption that may hold the engine back (an attached
    #: llama-server whose layout was not stated), for the log, the window and /health.
    kv_note: str | None = None
    #: The models an attached GGUF Studio port lists, each with its context.
    upstream_models: tuple[UpstreamModel, ...] = ()
    #: How the engine was set up to keep prompt prefixes, and why (the Model tab's).
    prefix_note: str | None = None
    #: A request pinned to any slot that has held a prompt still finds its prefix in the
    #: engine's RAM prompt cache (it runs with `PREFIX_CACHE_ARGS`, see the supervisor).
    pin_any_slot: bool = False
    #: It takes a request's `id_slot` (a llama-server); another GGUF Studio port refuses
    #: it (its slots are its own to place), so a pinned seat there is sent unpinned.
    takes_slot_ids: bool = True
    #: An attached llama-server seen to bring a prompt back from its RAM prompt cache into
    #: a slot that held another (`backend.llama.prefix_probe`): placement pins every turn
    #: there, and has a returning session's slot vacated first (`Seat.vacate`).
    finds_prefix_in_ram: bool = False
    #: What defeats prefix keeping on an attached engine and what to change (for the
    #: log, the window and /health); None: nothing known to.
    prefix_warning: str | None = None
    #: How fast it computes prompts and steps, and the batch it runs with, as measured
    #: after its load (backend.llama.engine_speed); None when not measured.
    speed: EngineSpeed | None = None
    #: It keeps a slot's context checkpoints in the slot's save file (our patch,
    #: `backend.llama.patches`), as asked after its load; None: not asked (it saves no
    #: slots here).
    parks_checkpoints: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 1:
            raise ValueError(f"an engine serves with at least 1 slot, not {self.slots!r}")

    @property
    def key(self) -> str:
        """The admission key: the base URL, and the model for a multi-model upstream."""
        return self.base_url if self.upstream_model is None else f"{self.base_url}#{self.upstream_model}"

    @property
    def per_request(self) -> int | None:
        """The most one request may hold: the cache's per-request limit, else the context."""
        return self.kv.per_request if self.kv is not None else self.context_length

    def describe_kv(self) -> str:
        """What the engine really gave, for people; "" while the cache is unknown."""
        if self.kv is None:
            return ""
        return "Engine gave: " + self.kv.describe(self.slots) + "."


@dataclass(frozen=True)
class ServedModel:
    """One of the models an engine elsewhere serves when it is another GGUF Studio port
    with several: each is an engine of its own here (its `serving` keyed by the port's
    address and the model), so admission keeps one line per model and that model's own
    slots and KV cache."""

    name: str
    #: As that port says: "ready", "loading", "unloaded", "evicted", "failed", ...
    state: str
    #: Its engine here: the model's exact slots and cache while ready there; one slot
    #: while it is loadable there (a request for it makes that port load it); None when
    #: nothing can be sent for it now.
    serving: Serving | None = None
    aliases: tuple[str, ...] = ()
    context_length: int | None = None
    embeddings: bool = False
    default: bool = False  #: that port's own default model
    error: str | None = None
    #: What its chats are rendered with there; None where that port does not say.
    chat_template: ChatTemplate | None = None


@dataclass(frozen=True)
class Snapshot:
    """What a load looks like right now; listeners get a new one on every change."""

    state: State = State.STOPPED
    model_id: str | None = None
    model_path: str | None = None
    #: Set exactly while READY: the engine's address, key, slots and cache.
    serving: Serving | None = None
    restarts: int = 0
    restarting: bool = False
    error: str | None = None
    pid: int | None = None
    log_path: str | None = None
    requested: LoadSettings | None = None  # what the load was asked for; None when remote
    # What the engine says it runs on (devices, layers offloaded, memory), once ready;
    # None for a llama-server GGUF Studio did not start.
    engine: EngineReport | None = None
    # The last load failed on the GPU; the same load with no GPU layers may work.
    cpu_retry_offered: bool = False
    #: Another GGUF Studio port's models, each with its engine here; () for any other
    #: engine (one model: `serving`).  Kept as last read while that port is out.
    models: tuple[ServedModel, ...] = ()

    def __post_init__(self) -> None:
        if (self.state is State.READY) != (self.serving is not None):
            raise ValueError("a snapshot serves exactly while it is READY")

    def describe_kv(self) -> str:
        """What the engine really gave, for people; "" while unknown."""
        return "" if self.serving is None else self.serving.describe_kv()


def _flag_name(arg: str) -> str:
    """The option an argument names, as llama.cpp spells it: `--api_key=x` is `--api-key`."""
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


Listener = Callable[[Snapshot], None]
LogListener = Callable[[str], None]


class LoadBackend(Protocol):
    """What runs (or watches) one llama-server; the service drives either kind alike."""

    @property
    def snapshot(self) -> Snapshot: ...

    def add_listener(self, listener: Listener) -> None: ...

    def add_log_listener(self, listener: LogListener) -> None: ...

    def log_tail(self, lines: int = 200) -> list[str]: ...

    async def unload(self) -> None: ...

    async def close(self) -> None: ...


class SnapshotPublisher:
    """The state half of a `LoadBackend`: the current snapshot, and listeners that hear
    every new one.  Subclasses change state only through `_set_state`."""

    def __init__(self, snapshot: Snapshot, logger: logging.Logger, what: str) -> None:
        self._snapshot = snapshot
        self._listeners: Listeners[[Snapshot]] = Listeners(logger, what)

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def add_listener(self, listener: Listener) -> None:
        self._listeners.add(listener)

    def _set_state(self, state: State, **changes: Any) -> None:
        """The one way the state changes.  Leaving READY ends serving: the `Serving`
        goes with it, so no caller spells out what "not serving" means."""
        if state is not State.READY:
            changes["serving"] = None
        self._snapshot = dataclasses.replace(self._snapshot, state=state, **changes)
        self._listeners(self._snapshot)
