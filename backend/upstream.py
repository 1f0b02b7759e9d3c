"""A llama-server that runs elsewhere, watched like one we supervise.

No process to own, but the same health watch, the same slots read from `/props` each
time it turns healthy, and the same snapshots, so admission and the gateway cannot tell
the difference.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Callable
from urllib.parse import urlsplit

import httpx

from backend.errors import LoadError, SettingsError
from backend.supervisor import Snapshot, State, read_props

log = logging.getLogger("gguf_studio.upstream")


class UpstreamWatcher:
    def __init__(self, url: str, *, interval: float = 1.0) -> None:
        self.base_url = normalise_base_url(url)
        self.interval = interval
        self._snapshot = Snapshot(model_id=None, model_path=None)
        self._listeners: list[Callable[[Snapshot], None]] = []
        self._task: asyncio.Task | None = None

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def add_listener(self, listener: Callable[[Snapshot], None]) -> None:
        self._listeners.append(listener)

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
        self._set_state(State.STOPPED, base_url=None, effective_parallel_slots=None)

    close = unload

    async def _watch(self) -> None:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while True:
                healthy = await _healthy(client, self.base_url)
                ready = self._snapshot.state is State.READY
                if healthy and not ready:
                    try:
                        props = await read_props(client, self.base_url)
                    except LoadError as exc:
                        log.warning("upstream is healthy but unusable: %s; retrying", exc)
                    else:
                        self._set_state(State.READY, base_url=self.base_url,
                                        effective_parallel_slots=props.effective_parallel_slots,
                                        context_length=props.context_length,
                                        model_id=props.model_alias or "upstream",
                                        restarting=False, error=None)
                elif not healthy and ready:
                    self._set_state(State.STARTING, base_url=None, effective_parallel_slots=None,
                                    restarting=True, error="The upstream llama-server stopped answering.")
                await asyncio.sleep(self.interval)

    def _set_state(self, state: State, **changes) -> None:
        self._snapshot = replace(self._snapshot, state=state, **changes)
        for listener in list(self._listeners):
            try:
                listener(self._snapshot)
            except Exception:
                log.exception("upstream listener failed")


def normalise_base_url(url: str) -> str:
    """'http://host:8080/v1/' -> 'http://host:8080'."""
    parts = urlsplit(url.strip())
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise SettingsError(f"The upstream must be an http(s) URL like http://host:8080, not {url!r}.")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


async def _healthy(client: httpx.AsyncClient, base_url: str) -> bool:
    try:
        return (await client.get(f"{base_url}/health")).status_code == 200
    except httpx.HTTPError:
        return False
