"""What the pool says about its models and the engines serving them: the values the
window, `/health`, the metrics and `serve` read (no paths, no keys), how one engine's
snapshot and admission queue make an `EngineStatus`, the engines elsewhere as `/health`
lists them, every model's card for /v1/models and /health (`model_cards`) and every
model's line and engines as the metrics count them.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any, Callable

from backend.llama.chat_template import ChatTemplate
from backend.llama.load import Serving, Snapshot, State
from backend.admission.admission_registry import AdmissionRegistry
from backend.port.catalog import ModelCard
from backend.port.metrics import EngineLoad, ModelLoad

__all__ = ["HERE", "EngineStatus", "ModelStatus", "Residency", "UpstreamStatus",
           "engine_note", "engine_status", "engines_elsewhere", "model_cards", "model_loads",
           "residency_of", "scrubbed"]

#: Where a local model's engine runs, in the window, /health and the metrics' labels.
HERE = "this machine"


class Residency(enum.Enum):
    """Where a local model is in its life; a remote one is READY or UNLOADED."""

    UNLOADED = "unloaded"  #: known, not in memory: loaded on its first request
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    EVICTED = "evicted"  #: unloaded to make room or for idleness; loaded again on demand
    FAILED = "failed"


@dataclass(frozen=True)
class EngineStatus:
    """One engine serving a model, for the window and /health (no paths, no keys)."""

    id: str  #: "local:<model>" or "remote:<url>"
    where: str  #: "this machine" (HERE) or "upstream N" (addresses stay out of /health)
    state: str
    slots: int | None
    kv: dict[str, object] | None
    active: int
    waiting: int
    reserved_tokens: int
    note: str | None = None
    #: Its measured prompt speed, step time and batch (EngineSpeed.to_dict); None: not measured.
    speed: dict[str, object] | None = None


@dataclass(frozen=True)
class ModelStatus:
    name: str
    aliases: tuple[str, ...]
    local: bool
    residency: Residency
    pinned: bool
    idle_ttl: float
    embeddings: bool
    default: bool
    context_length: int | None  #: what one request may use (prompt + output), when known
    decision: str  #: the last residency decision and its reason
    error: str | None
    engines: tuple[EngineStatus, ...]
    #: What its chats are rendered with; None where not known here (an engine
    #: elsewhere's model) or not a chat model (embeddings).
    chat_template: ChatTemplate | None = None


@dataclass(frozen=True)
class UpstreamStatus:
    """An engine elsewhere as its operator sees it in the window: its address (never its
    key), what it serves and how busy it is.  `engine.where` is its stable "upstream N"."""

    url: str
    kv_layout: str | None  #: "split" or "unified" as stated; None: not stated
    error: str | None  #: why it is out of the pool right now, if it is
    models: tuple[str, ...]  #: the model it serves first, then others it lists
    engine: EngineStatus


def engine_status(registry: AdmissionRegistry, engine_id: str, where: str,
                  snapshot: Snapshot) -> EngineStatus:
    """Engine `engine_id` as its snapshot and its admission queue have it now."""
    serving = snapshot.serving
    queue = registry.current_of(engine_id)
    return EngineStatus(
        engine_id if engine_id.startswith("local:") else where, where,
        "restarting" if snapshot.restarting else snapshot.state.value,
        serving.slots if serving is not None else None,
        serving.kv.to_dict() if serving is not None and serving.kv is not None else None,
        queue.active if queue is not None else 0,
        queue.line.waiting if queue is not None else 0,
        queue.reserved_tokens if queue is not None else 0,
        engine_note(serving) if serving is not None else None,
        serving.speed.to_dict() if serving is not None and serving.speed is not None else None)


def engine_note(serving: Serving) -> str | None:
    """What /health and the Pool tab's engine row say of an engine beyond its figures:
    an assumed KV layout, and what of its flags defeats prefix keeping (an attached
    llama-server's) with what to change; None: nothing."""
    notes = [note for note in (serving.kv_note, serving.prefix_warning) if note]
    return " ".join(notes) if notes else None


def residency_of(state: str) -> Residency:
    """A model's state as another GGUF Studio port says it, as a residency here."""
    try:
        return Residency(state)
    except ValueError:
        return Residency.UNLOADED


def scrubbed(text: str | None) -> str | None:
    """`text` (an engine's or a load's error) without the addresses and paths in it, for
    /health: a raw load error names RPC workers' addresses, upstream URLs (which may carry
    a key) and model files."""
    if not text:
        return text
    for pattern, stands_for in _PRIVATE:
        text = pattern.sub(stands_for, text)
    return text


#: What `scrubbed` takes out, in this order (a URL holds a path and an address).
_PRIVATE = (
    (re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+"), "<address>"),
    (re.compile(r"\[[0-9a-fA-F:.]*:[0-9a-fA-F:.]*\](?::\d+)?"), "<address>"),
    (re.compile(r"(?<![\w.:])(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?(?![\w.])"), "<address>"),
    (re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{1,4})*)?::"
                r"(?:[0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{1,4})*)?(?![\w:])"), "<address>"),
    (re.compile(r"(?<![\w:])[0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{1,4}){7}(?![\w:])"), "<address>"),
    (re.compile(r"(?<![\w.-])[a-zA-Z][\w-]*(?:\.[\w-]+)*:\d{2,5}(?!\d)"), "<address>"),
    (re.compile(r"(?<![\w.])[a-zA-Z]:[\\/][^\s'\"<>]*"), "<path>"),
    (re.compile(r"(?:~|(?<![\w.<>])\.{0,2})/[^\s'\"<>]+"), "<path>"),
)


def engines_elsewhere(upstreams: list[UpstreamStatus]) -> list[dict[str, Any]]:
    """Every engine elsewhere for /health, by its "upstream N" (never its address)."""
    found = []
    for upstream in upstreams:
        engine = upstream.engine
        error = scrubbed(upstream.error.replace(upstream.url, engine.where)
                         if upstream.error else None)
        found.append({"engine": engine.where, "state": engine.state,
                      "serving": engine.state == State.READY.value and bool(engine.slots),
                      "error": error, "models": list(upstream.models),
                      "kv_layout": upstream.kv_layout, "slots": engine.slots, "kv": engine.kv,
                      "active": engine.active, "reserved_tokens": engine.reserved_tokens,
                      "note": engine.note})
    return found


def model_loads(statuses: list[ModelStatus], registry: AdmissionRegistry) -> list[ModelLoad]:
    """Every model's line and engines right now, for the metrics and the activity."""
    loads = []
    for status in statuses:
        line = registry.find_line(status.name)
        engines = tuple(EngineLoad(
            engine.where, ready=engine.state == State.READY.value and bool(engine.slots),
            slots=engine.slots or 0, active=engine.active,
            kv_capacity=int(str(engine.kv["total"])) if engine.kv is not None else 0,
            kv_reserved=engine.reserved_tokens,
            prefill_tokens_per_second=_speed_figure(engine.speed, "prefill_tokens_per_second"),
            step_seconds=_speed_figure(engine.speed, "step_ms") / 1000)
            for engine in status.engines)
        loads.append(ModelLoad(status.name, line.waiting if line is not None else 0,
                               status.residency.value, engines))
    return loads


def model_cards(statuses: list[ModelStatus], serving_engines: list[tuple[str, str, Serving]], *,
                cap: int, parking: Callable[[str, Serving | None], dict[str, Any]]) -> list[ModelCard]:
    """Every model's card for /v1/models and /health: its state, context and output limit
    (at most `cap`, the operator's; 0: none), and its details: aliases, engines, chat
    template, and what parking does for it on its engine here (`parking(model, serving)`)."""
    cards = []
    local = {model: serving for model, where, serving in serving_engines if where == HERE}
    for status in statuses:
        context = status.context_length
        output = min(cap, context) if cap and context else (cap or context)
        cards.append(ModelCard(
            id=status.name, state=status.residency.value, context_length=context,
            max_output_tokens=output or None, default=status.default,
            details={"aliases": list(status.aliases), "local": status.local,
                     "pinned": status.pinned, "idle_ttl": status.idle_ttl,
                     "embeddings": status.embeddings, "decision": scrubbed(status.decision),
                     "error": scrubbed(status.error),
                     "engines": [dataclasses.asdict(e) for e in status.engines],
                     # What its chats are rendered with (none: chat routes are refused).
                     "chat_template": _chat_template(status.chat_template),
                     # What parking does for it (or why not), on its engine here.
                     "parking": parking(status.name, local.get(status.name))}))
    return cards


# --- helpers ------------------------------------------------------------------------------


def _speed_figure(speed: dict[str, object] | None, name: str) -> float:
    """One figure of an engine's measured speed (`EngineSpeed.to_dict`); 0 when unmeasured."""
    value = (speed or {}).get(name)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _chat_template(template: ChatTemplate | None) -> dict[str, Any] | None:
    """/health's words on a model's chat template; None where not known here."""
    if template is None:
        return None
    return dict(template.to_dict(), note=template.warning() or None)
