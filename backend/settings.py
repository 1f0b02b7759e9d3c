"""Settings: one dataclass, layered as saved file < environment < command line.

Every limit the gateway enforces lives here with its default, so that the window,
the command line and the environment all configure the same thing.

The saved file holds the API key, so it is private to the user: written 0600 in a 0700
directory, and a file or directory left readable by others (an older version wrote 0644)
is made private again whenever settings are loaded (backend.private_files).  `GGUF_STUDIO_API_KEY_FILE` names a
file holding the key, for people who keep the key out of the environment and out of
`ps` (the command line's `--api-key-file` does the same).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from backend.api_keys import check_api_key, read_api_key_file
from backend.errors import SettingsError
from backend.gpu_layers import parse_gpu_layers, read_saved_gpu_layers
from backend.private_files import make_private, write_private
from backend.rpc_workers import parse_rpc_workers

APP_NAME = "gguf-studio"
ENV_PREFIX = "GGUF_STUDIO_"
API_KEY_FILE_ENV = ENV_PREFIX + "API_KEY_FILE"


@dataclass
class Settings:
    # The OpenAI-compatible port.
    host: str = "127.0.0.1"
    port: int = 8899
    api_key: str = ""
    #: An OTLP/HTTP traces endpoint (http://collector:4318/v1/traces): each request's
    #: inspector record is exported there as a span (the `otel` extra); empty: nothing.
    otel_endpoint: str = ""
    #: A client's `traceparent` makes its span the parent of the request's span (the
    #: request joins the client's trace) instead of a link from a trace of the port's own:
    #: for clients the owner traces too (a client could otherwise pick the trace).
    otel_client_parent: bool = False
    allow_no_key: bool = False
    # Named keys were used here (backend.keys.key_store): every client must send a key from
    # then on, also after keys.json was deleted or emptied, which must not open the port
    # to everyone.  Once true in the saved file it stays so (`save`, `remember_keys_required`).
    keys_required: bool = False
    # Web pages (origins) and host names the port accepts beyond this machine's own; see
    # backend/port/access_guard.py.  The environment may give them comma- or space-separated.
    allow_origins: list[str] = field(default_factory=list)
    allow_hosts: list[str] = field(default_factory=list)
    # LAN discovery and enrolment (backend/app/sharing/discovery.py, backend/keys/enrolments.py): the
    # port announces itself over mDNS only when asked (and only while it shares on the
    # LAN with keys required), under the owner's name ("": this machine's); teammates
    # may ask it for a key while it is announced or until accept_enrolments_until (a
    # wall-clock time: `serve --accept-enrolments MINUTES`, the Sharing tab), unless the
    # owner turns enrolment off (backend/keys/enrolment_window.py); unanswered requests
    # expire after enrolment_ttl seconds.
    advertise: bool = False
    advertise_name: str = ""
    allow_enrolment: bool = True
    accept_enrolments_until: float = 0.0
    enrolment_ttl: float = 600.0
    # Admission.  max_queue 0 means "16 x slots, at least 64"; see effective_max_queue.
    max_queue: int = 0
    queue_timeout: float = 600.0
    keepalive_interval: float = 5.0
    # Seconds a request whose client hung up before its answer began keeps its place in
    # line and its engine's work, for the same request sent again to join it
    # (backend/port/resends.py); 0: its work is cut at once.  Claude Code resends at once
    # when its watchdog fires, OpenCode after backoffs of up to 23 s (bench/README.md,
    # watchdogs); a hang-up nobody follows holds its slot no longer than this.
    resend_grace: float = 30.0
    max_output_tokens: int = 0
    # Output tokens reserved for a request that sends no limit (backend.admission.prompt_tokens).
    default_output_tokens: int = 2048
    # Largest request body; 0 means this default (a port never takes unlimited bodies).
    max_body_bytes: int = 32 * 1024 * 1024
    # Bytes of request bodies that requests waiting in line may hold together (bodies are
    # read before admission); past it a request that would wait gets 429.  0 = no bound.
    max_waiting_body_bytes: int = 256 * 1024 * 1024
    # Bytes of request bodies being read, parsed and counted at once, before they wait in
    # line or run (their parsed form takes several times their bytes); past it a request
    # gets 429.  0 = no bound.  A body alone always passes (max_body_bytes bounds it).
    max_incoming_body_bytes: int = 64 * 1024 * 1024
    # Prompt counts the port asks a model's counting engine for at once; past it a request
    # that waits for its count gets 429.  0 means twice the slots of the model's engines;
    # see effective_max_prompt_counts.
    max_prompt_counts: int = 0
    # Connections the port keeps open at once; past it, the oldest one that has not sent
    # a whole request makes room (as nginx drains idle keep-alive connections), else the
    # newcomer is closed.  Far below the usual file limit (1024 at the least).
    max_connections: int = 512
    # Seconds a client may take to send a request's head, and to send the next part of
    # its body (nginx's client_header_timeout / client_body_timeout, 60 s there: a real
    # client sends its head in one packet, so half of it is plenty); the whole body gets
    # this plus a second per KiB (backend.port.request_body.MIN_BODY_RATE).
    header_timeout: float = 30.0
    # Seconds a client may leave its answer unread (nothing of it accepted) before the
    # port drops it and frees its slot; 0 = never.  Twice nginx's `send_timeout` (60 s):
    # a slow reader always makes some progress in that time, a client stopped in a
    # debugger or gone without closing holds no slot longer than two minutes.
    client_stall_timeout: float = 120.0
    reload_grace: float = 30.0
    # MiB of disk the parked session prefixes may take (backend.llama.slot_parking): saved
    # before an idle TTL, eviction, unload or exit, restored on the session's next turn;
    # past it the least recently used go.  0: nothing is parked.
    parked_slots_mib: int = 4096
    # Days a parked prefix (a prompt at rest) is kept unused, neither saved nor restored,
    # before it is removed; the files of a revoked or deleted key go with it.  0: nothing
    # is parked.
    parked_slots_days: float = 7.0
    admission_enabled: bool = True
    # Where a request goes among its model's engines (backend.admission.placement):
    # "keep-prefixes", each session back to the engine and slot holding its prefix, or
    # "hash-ring", each session on the engine its name falls to on a consistent-hash
    # ring.  A model of the models file may name its own.
    placement: str = "keep-prefixes"
    # The engine.
    llama_server: str = ""
    load_timeout: float = 300.0
    # The longest a running stream may wait for one engine step while a prompt is
    # computed beside it, in milliseconds (0: the engine's own batch sizes): a local
    # engine of more than one slot gets the batch that stays within it
    # (backend.llama.engine_speed).
    stall_budget_ms: float = 250.0
    max_restarts: int = 5
    stop_timeout: float = 10.0
    # Last load, so that `serve` and the window can offer it again.
    model: str = ""
    upstream: str = ""
    # The models file (backend.app.pool.models_file): the models and upstreams `serve` runs
    # side by side; flags add to it.
    models_file: str = ""
    # How the upstream llama-server's KV cache is laid out, which it cannot report:
    # "split" (each slot its own share, the default of -np N), "unified" (--kv-unified),
    # or "" (not stated: one shared pool of one slot's context is assumed).
    upstream_kv: str = ""
    parallel: str = "auto"
    ctx_size: int = 0
    n_gpu_layers: str = "auto"  # "auto", "all", "none" or a number (backend/gpu_layers.py)
    threads: int = 0
    extra_args: list[str] = field(default_factory=list)
    # Machines running `gguf-studio rpc-worker` the model is spread over ("host:port";
    # the environment gives them comma- or space-separated).
    rpc: list[str] = field(default_factory=list)
    # The chat template picked for the model: "" its own, a llama.cpp built-in's name, a
    # Jinja file, or "none" (backend.llama.chat_template).
    chat_template: str = ""

    def __post_init__(self) -> None:
        check_api_key(self.api_key)  # from any source: file, environment, flag, window
        check_placement(self.placement)

    def effective_max_queue(self, slots: int) -> int:
        """Waiting places for a load with `slots` slots; 0 from the user means default."""
        if self.max_queue > 0:
            return self.max_queue
        return max(64, 16 * max(slots, 1))

    def effective_max_prompt_counts(self, slots: int) -> int:
        """Prompt counts asked at once for a model whose engines have `slots` slots."""
        if self.max_prompt_counts > 0:
            return self.max_prompt_counts
        return 2 * max(slots, 1)

    def effective_max_body_bytes(self) -> int:
        """The body limit; 0 from the user means the default."""
        return self.max_body_bytes or Settings.max_body_bytes

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    # --- persistence ---------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | None = None, environ: Mapping[str, str] | None = None) -> "Settings":
        """Saved settings, then overridden by GGUF_STUDIO_* environment variables."""
        path = path or settings_path()
        make_private(path)
        saved = _read_saved(path) if path.is_file() else {}
        return cls().with_overrides(saved).with_overrides(env_overrides(environ if environ is not None else os.environ))

    def save(self, path: Path | None = None, environ: Mapping[str, str] | None = None) -> None:
        """Write the settings, except values that came from the environment: those stay
        as they were saved, so an exported GGUF_STUDIO_* is never made permanent."""
        path = path or settings_path()
        values = dataclasses.asdict(self)
        from_env = Settings().with_overrides(env_overrides(os.environ if environ is None else environ))
        previous = _read_saved(path) if path.is_file() else {}
        for name in env_overrides(os.environ if environ is None else environ):
            if values[name] == getattr(from_env, name):
                values[name] = previous.get(name, getattr(Settings(), name))
        values["keys_required"] = values["keys_required"] or previous.get("keys_required") is True
        write_private(path, json.dumps(values, indent=2).encode())

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Settings":
        """A copy with `overrides` (field name -> raw value) converted and applied."""
        types = {f.name: str(f.type) for f in fields(self)}
        converted = {}
        for name, raw in overrides.items():
            if raw is None:
                continue
            if name not in types:
                raise SettingsError(f"Unknown setting {name!r}.")
            converted[name] = _convert(name, types[name], raw)
        return dataclasses.replace(self, **converted)


def remember_keys_required(path: Path | None = None) -> None:
    """Mark in the saved settings that named keys were used (`Settings.keys_required`),
    changing nothing else in the file."""
    path = path or settings_path()
    saved = _read_saved(path) if path.is_file() else {}
    if saved.get("keys_required") is not True:
        raw = json.loads(path.read_text()) if path.is_file() else {}
        write_private(path, json.dumps(dict(raw, keys_required=True), indent=2).encode())


def settings_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "settings.json"


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """GGUF_STUDIO_MAX_QUEUE=8 -> {"max_queue": "8"}, for every known setting; the key
    read from the file GGUF_STUDIO_API_KEY_FILE names counts as GGUF_STUDIO_API_KEY."""
    out = {}
    for f in fields(Settings):
        key = ENV_PREFIX + f.name.upper()
        if key in environ:
            out[f.name] = environ[key]
    if environ.get(API_KEY_FILE_ENV):
        if "api_key" in out:
            raise SettingsError(f"Both {env_var('api_key')} and {API_KEY_FILE_ENV} are set; "
                                "set only one of them.")
        out["api_key"] = read_api_key_file(environ[API_KEY_FILE_ENV])
    return out


def _read_saved(path: Path) -> dict[str, Any]:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"The settings file {path.name} is not readable JSON: {exc}") from None
    if not isinstance(saved, dict):
        raise SettingsError(f"The settings file {path.name} does not hold settings.")
    known = {f.name for f in fields(Settings)}
    values = {k: v for k, v in saved.items() if k in known}
    if "n_gpu_layers" in values:
        values["n_gpu_layers"] = read_saved_gpu_layers(values["n_gpu_layers"])
    return values


def parse_names(text: str) -> list[str]:
    """Origins or host names typed on one line, separated by commas or spaces."""
    return [part for part in text.replace(",", " ").split() if part]


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


#: The KV layouts an operator may state for an upstream (backend.llama.kv_capacity.KvLayout).
UPSTREAM_KV_LAYOUTS = ("split", "unified")


#: The placement policies an operator may name (backend.admission.admission_registry.placement_named).
PLACEMENTS = ("keep-prefixes", "hash-ring")


def check_placement(raw: Any) -> str:
    """A placement policy's name as an operator wrote it: one of PLACEMENTS (SettingsError)."""
    word = str(raw).strip().lower()
    if word not in PLACEMENTS:
        raise SettingsError(f"The placement must be one of {', '.join(PLACEMENTS)}, not {raw!r}.")
    return word


def _upstream_kv(raw: Any) -> str:
    word = str(raw).strip().lower()
    if word and word not in UPSTREAM_KV_LAYOUTS:
        raise ValueError(raw)
    return word


def _convert(name: str, type_name: str, raw: Any) -> Any:
    try:
        if type_name == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in {"1", "true", "yes", "on"}:
                return True
            if text in {"0", "false", "no", "off", ""}:
                return False
            raise ValueError(raw)
        value: float
        if name == "rpc":
            return list(parse_rpc_workers(raw))
        if type_name == "int":
            value = int(raw)
        elif type_name == "float":
            value = float(raw)
        elif type_name.startswith("list"):
            return [str(v) for v in raw] if isinstance(raw, (list, tuple)) else str(raw).split()
        elif name == "n_gpu_layers":
            return parse_gpu_layers(raw)
        elif name == "upstream_kv":
            return _upstream_kv(raw)
        elif name == "placement":
            return check_placement(raw)
        else:
            return str(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"Setting {name} has an unusable value {raw!r}.") from None
    if value < 0:
        raise SettingsError(f"Setting {name} must not be negative (got {raw!r}).")
    return value
