"""The gateway test harness: a port on 127.0.0.1:0 in front of any llama-server-like
base URL, and helpers to read what comes back.  Used by test_gateway*.py; the `fake` and
`gw` fixtures live in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx

from backend.port.access_guard import AccessGuard
from backend.errors import RETRY_SOON, ModelNotReady
from backend.llama.kv_capacity import KvCapacity
from backend.admission.line import DEFAULT_MODEL
from backend.admission.admission_registry import AdmissionRegistry
from backend.keys.key_store import KeyStore
from backend.port.catalog import ModelCard
from backend.admission.flow_control import FlowControl
from backend.port.gateway import not_ready_message
from backend.port.exchange_host import PrefixSteward
from backend.port.gateway import Gateway as PortGateway, create_app
from backend.port.server import GatewayServer
from backend.port.request_log import RequestLog
from backend.port.metrics import Metrics
from backend.port.route import Route
from backend.settings import Settings
from backend.llama.load import Serving, Snapshot, State

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
KEY = "sk-test-key-0123456789"

# --- harness -------------------------------------------------------------------------


class Context:
    """A GatewayContext whose snapshot the test controls."""

    def __init__(self, settings: Settings, snapshot: Snapshot) -> None:
        self.settings = settings
        self.registry = AdmissionRegistry(
            max_waiting_for=lambda slots: self.settings.effective_max_queue(slots))
        self.metrics = Metrics()
        self.metrics.bind_registry(self.registry)
        self._snapshot = snapshot
        self.metrics.set_backend(snapshot)
        self.keys: KeyStore | None = None
        self.flows = FlowControl()
        self.requests = RequestLog()
        self.chat_secret = ""
        self.parking: PrefixSteward | None = None

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self.metrics.set_backend(snapshot)

    def route(self, path: str, requested: object) -> Route:
        """One load, as a port without a pool: any model name reaches it while ready."""
        if self._snapshot.state is not State.READY or self.registry.current is None:
            raise ModelNotReady(not_ready_message(self._snapshot), retry_after=RETRY_SOON)
        return Route(DEFAULT_MODEL)

    def model_cards(self) -> list[ModelCard]:
        serving = self._snapshot.serving
        if serving is None or not self._snapshot.model_id:
            return []
        context = serving.per_request
        cap = self.settings.max_output_tokens
        output = min(cap, context) if cap and context else (cap or context)
        return [ModelCard(self._snapshot.model_id, "ready", context, output or None, True)]

    def engines_elsewhere(self) -> list[dict[str, Any]]:
        return []


@dataclass
class Gateway:
    ctx: Context
    server: GatewayServer
    client: httpx.AsyncClient
    url: str
    upstream_url: str

    @property
    def registry(self) -> AdmissionRegistry:
        return self.ctx.registry

    @property
    def metrics(self) -> Metrics:
        return self.ctx.metrics

    @property
    def guard(self) -> AccessGuard:
        served = self.server.served
        assert isinstance(served, PortGateway)
        return served.guard

    def configure(self, **changes: Any) -> None:
        """Change settings live: the gateway reads them on every request."""
        self.ctx.settings = self.ctx.settings.replace(**changes)

    def rejections(self, reason: str) -> float:
        return self.metrics.value("gguf_studio_rejections_total", {"reason": reason})

    def requests(self, route: str, status: int) -> float:
        return self.metrics.value("gguf_studio_requests_total", {"route": route, "status": str(status)})

    def cancellations(self, stage: str) -> float:
        return self.metrics.value("gguf_studio_cancellations_total", {"stage": stage})


@contextlib.asynccontextmanager
async def open_gateway(base_url: str, slots: int, *, model_id: str = "fake-model",
                       context_length: int = 4096, kv: KvCapacity | None = None,
                       **settings: Any) -> AsyncIterator[Gateway]:
    """A gateway on 127.0.0.1:0 in front of the llama-server at `base_url`."""
    # No grace for resends (backend.port.resends): a client that leaves is cut at once,
    # what these tests of leaving clients assert; tests/backend/port/test_resends.py sets it.
    defaults: dict[str, Any] = dict(keepalive_interval=0.05, queue_timeout=30.0, resend_grace=0)
    defaults.update(settings)
    serving = Serving(base_url, slots, context_length=context_length, kv=kv)
    snapshot = Snapshot(state=State.READY, model_id=model_id, serving=serving)
    ctx = Context(Settings(**defaults), snapshot)
    ctx.registry.activate(serving)
    server = await GatewayServer.start(create_app(ctx), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}"
    client = httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False)
    try:
        yield Gateway(ctx, server, client, url, base_url)
    finally:
        await client.aclose()
        await server.stop()


async def until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    """Wait until `condition()` holds (polled), or fail after `timeout` seconds.  The
    default is a guard against a hang, not a speed claim: on 2 loaded cores a step the
    tests wait for has taken over 5 s.  A test that claims "at once" passes its own."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.002)
    await asyncio.wait_for(poll(), timeout)


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                 **kwargs: Any) -> tuple[httpx.Response, bytes]:
    """POST and read the whole (streamed) answer."""
    async with client.stream("POST", path, json=body, **kwargs) as response:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    return response, raw


def events(raw: bytes) -> list[dict[str, Any]]:
    """SSE blocks as {"event", "data" (parsed JSON, "[DONE]" or None), "comment"}."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        event: dict[str, Any] = {"event": None, "data": None, "comment": None}
        for line in block.split("\n"):
            if line.startswith(":"):
                event["comment"] = line[1:].strip()
            elif line.startswith("event:"):
                event["event"] = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                event["data"] = data if data == "[DONE]" else json.loads(data)
        out.append(event)
    return out


def chat(stream_: bool = False, **fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "stream": stream_, **fields}


def assert_clean_error(response: httpx.Response, status: int, code: str,
                       gw: Gateway | None = None) -> dict[str, Any]:
    """An OpenAI-style error body with a string code and nothing internal in it."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "code", "param"} <= set(error)
    assert error["code"] == code and isinstance(error["code"], str)
    assert_no_internals(response.text, gw)
    return error


def assert_no_internals(text: str, gw: Gateway | None = None) -> None:
    for needle in ("127.0.0.1", "Traceback", "/srv/", "/home/", "/tmp/", "/usr/", "/work/",
                   "secret-dir", ".py", "http://"):
        assert needle not in text, f"{needle!r} leaked in {text!r}"
    if gw is not None:
        for url in (gw.url, gw.upstream_url):
            port = url.rsplit(":", 1)[1]
            # Whole numbers only: a port's digits can turn up inside a timing or a count.
            assert not re.search(rf"(?<![\d.]){port}(?![\d.])", text), \
                f"port {port} leaked in {text!r}"


@contextlib.asynccontextmanager
async def holding(gw: Gateway, n: int = 1, **fake: Any) -> AsyncIterator[list[asyncio.Task]]:
    """`n` streams that occupy slots until the block ends (they hang upstream)."""
    before = gw.registry.total_active
    tasks = [asyncio.create_task(stream(gw.client, CHAT, chat(True, fake={"hang": True, **fake})))
             for _ in range(n)]
    await until(lambda: gw.registry.total_active == before + n)
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await until(lambda: gw.registry.total_active == before)


async def cancel(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
