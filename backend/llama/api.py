"""A client for llama-server's own API (not the OpenAI one the relay forwards).

Every caller that asks the engine about itself (the supervisor's health wait and props
read, the remote-engine watch, activity's token count) goes through `EngineClient`,
which never takes proxies from the environment: the engine is ours or named by the user.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType

import httpx

from backend.errors import LoadError


@dataclass(frozen=True)
class EngineProps:
    """What llama-server's /props says about the load it runs."""

    effective_parallel_slots: int
    context_length: int | None  # per slot
    model_alias: str | None


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
                "/health", timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_healthy(self, interval: float = 0.05) -> None:
        """Returns once /health answers 200; the caller bounds the wait."""
        while not await self.healthy(timeout=2.0):
            await asyncio.sleep(interval)

    async def props(self) -> EngineProps:
        """Slots and per-slot context from /props; a LoadError when they are missing."""
        try:
            props = (await self._client.get("/props")).raise_for_status().json()
            slots = int(props["total_slots"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise LoadError(f"llama-server became healthy but did not report its slots ({exc}).") from None
        generation = props.get("default_generation_settings") or {}
        ctx = generation.get("n_ctx") or props.get("n_ctx")
        return EngineProps(slots, int(ctx) if ctx else None, props.get("model_alias"))

    async def metrics_text(self) -> str | None:
        """The Prometheus text of /metrics, or None when the engine does not answer it."""
        try:
            response = await self._client.get("/metrics")
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None
