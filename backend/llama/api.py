"""A client for an engine's own API (not the OpenAI one the relay forwards).

Every caller that asks the engine about itself (the supervisor's health wait and props
read, the remote-engine watch, activity's token count) goes through `EngineClient`,
which never takes proxies from the environment: the engine is ours or named by the user.
The engine is a llama-server, or (for the remote-engine watch) another GGUF Studio
port, whose `/health` says what it serves (`StudioHealth`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from backend.api_paths import HEALTH, METRICS, MODELS
from backend.errors import LoadError
from backend.llama.chat_template import ChatTemplate
from backend.llama.kv_capacity import KvCapacity, kv_from_health

__all__ = ["EngineClient", "EngineProps", "HealthAnswer", "StudioEngineHealth", "StudioHealth",
           "StudioModelHealth", "UpstreamModel", "engine_headers"]


@dataclass(frozen=True)
class EngineProps:
    """What llama-server's /props says about the load it runs."""

    effective_parallel_slots: int
    context_length: int | None  # per slot
    model_alias: str | None
    build_info: str | None = None
    #: Where the engine's model file is on its machine: told apart, never shown.
    model_path: str | None = None


@dataclass(frozen=True)
class HealthAnswer:
    """What `/health` answered: its status and JSON body (None when not JSON)."""

    status: int
    body: Any

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass(frozen=True)
class StudioHealth:
    """Another GGUF Studio port's `/health`: what it serves, and its exact capacity."""

    state: str
    model: str | None
    slots: int | None
    kv: KvCapacity | None
    active: int = 0
    waiting: int = 0
    #: Every model it serves or can load, with its engines; None from a port older than
    #: the pool, whose `/health` tells only of its one model (the top-level fields).
    models: tuple[StudioModelHealth, ...] | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready" and bool(self.slots) and self.kv is not None

    @classmethod
    def read(cls, body: Any) -> StudioHealth | None:
        """The body's meaning when a GGUF Studio port sent it; None for anything else
        (llama-server's is `{"status": "ok"}`)."""
        if not (isinstance(body, dict) and isinstance(body.get("state"), str)
                and "effective_parallel_slots" in body and "kv" in body):
            return None
        model = body.get("model")
        return cls(state=body["state"], model=model if isinstance(model, str) and model else None,
                   slots=_positive(body.get("effective_parallel_slots")),
                   kv=kv_from_health(body.get("kv")),
                   active=body["active"] if _count(body.get("active")) else 0,
                   waiting=body["waiting"] if _count(body.get("waiting")) else 0,
                   models=_studio_models(body.get("models")))


@dataclass(frozen=True)
class StudioEngineHealth:
    """One engine that serves a model inside another GGUF Studio port."""

    state: str
    slots: int | None
    kv: KvCapacity | None

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.slots is not None


@dataclass(frozen=True)
class StudioModelHealth:
    """One model another GGUF Studio port lists in its `/health`: its state as that port
    says ("ready", "loading", "unloaded", "evicted", "failed", ...), and its engines."""

    id: str
    state: str
    default: bool = False
    context_length: int | None = None
    aliases: tuple[str, ...] = ()
    local: bool = True  #: run by that port itself, so it loads there on demand
    embeddings: bool = False
    error: str | None = None
    engines: tuple[StudioEngineHealth, ...] = ()
    #: What its chats are rendered with there; None where that port does not say.
    chat_template: ChatTemplate | None = None

    @property
    def loadable(self) -> bool:
        """Not loaded there, but a request for it makes that port load it."""
        return self.local and self.state in LOADABLE_STATES

    @property
    def slots(self) -> int | None:
        """Its ready engines' slots together, or None while none is ready: that port
        routes a request to whichever of its engines has room."""
        slots = sum(engine.slots or 0 for engine in self.engines if engine.ready)
        return slots if self.state == "ready" and slots > 0 else None

    @property
    def kv(self) -> KvCapacity | None:
        """Its ready engines' caches as one: the one engine's exactly; for several, their
        tokens together, with the largest per-request limit among them (split when every
        cache is split with the same share per slot, else one pool).  None while any
        ready engine's cache is unknown (slots alone count then)."""
        caches = [engine.kv for engine in self.engines if engine.ready]
        if not caches or any(kv is None for kv in caches):
            return None
        known = [kv for kv in caches if kv is not None]
        if len(known) == 1:
            return known[0]
        total = sum(kv.total for kv in known)
        per_request = max(kv.per_request for kv in known)
        split = all(not kv.unified and kv.per_request == per_request for kv in known)
        return KvCapacity(total, per_request, unified=not split)


@dataclass(frozen=True)
class UpstreamModel:
    """One model another port lists in `/v1/models`, with what one request may use."""

    id: str
    context_length: int | None = None
    max_output_tokens: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"id": self.id, "context_length": self.context_length,
                "max_output_tokens": self.max_output_tokens}


def engine_headers(api_key: str | None) -> dict[str, str]:
    """What every request to the engine carries so that an engine started with
    `--api-key` (ours always are) accepts it."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class EngineClient:
    """llama-server's /health, /props and /metrics at `base_url`; use as `async with`."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 5.0) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout, trust_env=False,
                                         headers=engine_headers(api_key))

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def healthy(self, timeout: float | None = None) -> bool:
        """True when /health answers 200; False for any other answer or none."""
        try:
            response = await self._client.get(
                HEALTH, timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_healthy(self, interval: float = 0.05) -> None:
        """Returns once /health answers 200; the caller bounds the wait."""
        while not await self.healthy(timeout=2.0):
            await asyncio.sleep(interval)

    async def health(self, timeout: float | None = None) -> HealthAnswer | None:
        """What /health answered, or None when nothing answered."""
        try:
            response = await self._client.get(
                HEALTH, timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        except httpx.HTTPError:
            return None
        try:
            body = response.json()
        except ValueError:
            body = None
        return HealthAnswer(response.status_code, body)

    async def props(self) -> EngineProps:
        """Slots and per-slot context from /props; a LoadError when they are missing."""
        try:
            response = await self._client.get("/props")
            _refuse_unauthorized(response)
            props = response.raise_for_status().json()
            slots = int(props["total_slots"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise LoadError(f"llama-server became healthy but did not report its slots ({exc}).") from None
        generation = props.get("default_generation_settings") or {}
        ctx = generation.get("n_ctx") or props.get("n_ctx")
        return EngineProps(slots, int(ctx) if ctx else None, props.get("model_alias"),
                           _text(props.get("build_info")), _text(props.get("model_path")))

    async def slot_contexts(self) -> tuple[int, ...] | None:
        """Each slot's context from /slots, or None where the engine keeps /slots off
        (`--no-slots`) or it does not read as slots."""
        try:
            response = await self._client.get("/slots")
            if response.status_code != 200:
                return None
            slots = response.json()
            contexts = tuple(slot["n_ctx"] for slot in slots)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return contexts if contexts and all(_positive(n) for n in contexts) else None

    async def models(self) -> tuple[UpstreamModel, ...]:
        """The models /v1/models lists, with their context (GGUF Studio's
        `context_length`, llama-server's `meta.n_ctx`); a LoadError when unreadable."""
        try:
            response = await self._client.get(MODELS)
            _refuse_unauthorized(response)
            listed = response.raise_for_status().json()["data"]
            # An entry with `alias_of` is another name of a model listed already (GGUF
            # Studio's `default`), not a model.
            return tuple(_listed_model(entry) for entry in listed if isinstance(entry, dict)
                         and isinstance(entry.get("id"), str) and entry["id"]
                         and "alias_of" not in entry)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise LoadError(f"The upstream did not list its models ({exc}).") from None

    async def tokenize(self, text: str) -> list[int]:
        """The engine's tokens of `text` (llama-server's /tokenize)."""
        answer = await self.post_json("/tokenize", {"content": text})
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return [t for t in tokens if isinstance(t, int)] if isinstance(tokens, list) else []

    async def post_json(self, path: str, body: dict[str, Any], *,
                        timeout: float | None = None) -> Any:
        """POST `body` to `path` and the JSON answer; httpx errors for a failed one."""
        response = await self._client.post(
            path, json=body, timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        _refuse_unauthorized(response)
        return response.raise_for_status().json()

    async def metrics_text(self) -> str | None:
        """The Prometheus text of /metrics, or None when the engine does not answer it."""
        try:
            response = await self._client.get(METRICS)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None


#: The states of a model another GGUF Studio port loads when a request asks for it.
LOADABLE_STATES = frozenset({"unloaded", "evicted", "loading"})


def _studio_models(listed: Any) -> tuple[StudioModelHealth, ...] | None:
    if not isinstance(listed, list):
        return None
    found = []
    for entry in listed:
        if not (isinstance(entry, dict) and _text(entry.get("id")) and _text(entry.get("state"))):
            continue
        aliases = entry.get("aliases")
        engines = entry.get("engines")
        found.append(StudioModelHealth(
            entry["id"], entry["state"], default=entry.get("default") is True,
            context_length=_positive(entry.get("context_length")),
            aliases=tuple(a for a in aliases if _text(a)) if isinstance(aliases, list) else (),
            local=entry.get("local") is not False, embeddings=entry.get("embeddings") is True,
            error=_text(entry.get("error")),
            engines=tuple(StudioEngineHealth(str(e.get("state")), _positive(e.get("slots")),
                                             kv_from_health(e.get("kv")))
                          for e in engines if isinstance(e, dict))
            if isinstance(engines, list) else (),
            chat_template=ChatTemplate.from_dict(entry.get("chat_template"))))
    return tuple(found)


def _refuse_unauthorized(response: httpx.Response) -> None:
    if response.status_code in (401, 403):
        raise LoadError("The upstream refused the API key: give the key it requires.")


def _listed_model(entry: dict[str, Any]) -> UpstreamModel:
    meta = entry.get("meta")
    context = entry.get("context_length", meta.get("n_ctx") if isinstance(meta, dict) else None)
    return UpstreamModel(entry["id"], _positive(context), _positive(entry.get("max_output_tokens")))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> int | None:
    return value if _count(value) and value > 0 else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
