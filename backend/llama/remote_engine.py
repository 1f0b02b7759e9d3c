"""A llama-server that runs elsewhere, watched like one we supervise.

No process to own, but the same health watch, the same slots read from `/props` each
time it turns healthy, and the same snapshots, so admission and the gateway cannot tell
the difference.  Its KV cache is not reported by `/props` beyond one slot's context, so
it is taken conservatively as one shared pool of that size (`kv_from_props`).
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

from backend.llama.api import EngineClient
from backend.errors import LoadError, SettingsError
from backend.llama.kv_capacity import kv_from_props
from backend.llama.load import LogListener, Serving, Snapshot, SnapshotPublisher, State

__all__ = ["RemoteEngine", "normalise_base_url"]

log = logging.getLogger("gguf_studio.remote_engine")


class RemoteEngine(SnapshotPublisher):
    """Watches a llama-server at `url`; a `LoadBackend` without a process or logs."""

    def __init__(self, url: str, *, api_key: str | None = None, interval: float = 1.0) -> None:
        self.base_url = normalise_base_url(url)
        self.api_key = api_key
        self.interval = interval
        super().__init__(Snapshot(model_id=None, model_path=None), log, "remote engine listener")
        self._task: asyncio.Task[None] | None = None

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
        self._set_state(State.STOPPED)

    async def close(self) -> None:
        await self.unload()

    async def _watch(self) -> None:
        async with EngineClient(self.base_url, api_key=self.api_key, timeout=5.0) as engine:
            while True:
                healthy = await engine.healthy()
                ready = self._snapshot.state is State.READY
                if healthy and not ready:
                    try:
                        props = await engine.props()
                    except LoadError as exc:
                        log.warning("remote engine is healthy but unusable: %s; retrying", exc)
                    else:
                        serving = Serving(self.base_url, props.effective_parallel_slots,
                                          context_length=props.context_length,
                                          kv=kv_from_props(props.context_length),
                                          api_key=self.api_key)
                        self._set_state(State.READY, serving=serving,
                                        model_id=props.model_alias or "upstream",
                                        restarting=False, error=None)
                elif not healthy and ready:
                    self._set_state(State.STARTING, restarting=True, error="The upstream llama-server stopped answering.")
                await asyncio.sleep(self.interval)


def normalise_base_url(url: str) -> str:
    """'http://host:8080/v1/' -> 'http://host:8080'."""
    parts = urlsplit(url.strip())
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise SettingsError(f"The upstream must be an http(s) URL like http://host:8080, not {url!r}.")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"
