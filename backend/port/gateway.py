"""The OpenAI-compatible port: routes, auth, admission, forwarding, metrics.

Gated (a slot of the model is needed, through the admission queue):
`POST /v1/chat/completions`, `/v1/responses`, `/v1/completions`, `/v1/messages`,
`/v1/embeddings`.  Ungated: `GET /v1/models`, `/health`, `/metrics`, `/requests` (the
request inspector's ring, `backend.port.request_log`: all of it for the owner's key, a
named key's own records for that key, and the Chat tab's own for its secret; with the
requests under way, `in_flight`).  Nothing else, and none of llama-server's own
endpoints, is reachable: every other path is a 404.

Auth, when `settings.api_key` is set: `Authorization: Bearer KEY` or `x-api-key: KEY`,
compared in constant time, on every route except `/health` (left open for probes).  The
key check, its throttle and the browser checks (Origin, Host, content type, CORS) live in
`backend.port.access_guard`.

`create_app(ctx)` builds the Starlette app; `backend.port.server` serves it.
Errors become answers in `backend.port.http_errors`, the streaming relay lives in
`backend.port.relay`, body checks and the output cap in `backend.port.request_body`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from typing import Any, AsyncIterator, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette import routing
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.api_paths import (CHAT, COMPLETIONS, EMBEDDINGS, ENROLMENTS, HEALTH, MESSAGES, METRICS,
                               MODELS, REQUESTS, RESPONSES)
from backend.port import http_errors
from backend.keys.key_store import OWNER_NAME, KeyStore
from backend.admission.caller import Caller
from backend.port.access_guard import AccessGuard
from backend.admission.flow import Band
from backend.admission.flow_control import FlowControl, requested_band
from backend.port.access_log import KEY_NAME, log_request
from backend.admission.admission_registry import AdmissionRegistry
from backend.port.catalog import ModelCard, model_list
from backend.port.enrolment_endpoint import EnrolmentEndpoint
from backend.port.health import health_answer
from backend.errors import (RETRY_SOON, InvalidRequest, KeyRevoked, MethodNotAllowed,
                            ModelNotReady, NotFound, RequestError, Unauthorized, UpgradeRequired)
from backend.port.server import ABORT_EXTENSION, BODY_WRITER_EXTENSION
from backend.port.metrics import UNROUTED, Metrics, ModelCounts
from backend.admission.request_planner import RequestPlanner
from backend.admission.session_book import Sessions
from backend.port.tokenizer_client import HttpEngineTokenizer
from backend.port.gated_request import GatedRequest
from backend.port.in_flight import in_flight_record
from backend.port.audience import Listener
from backend.port.exchange_host import PrefixSteward
from backend.port.relay import Exchange
from backend.port.resends import JOINED_FINISHED, FinishedAnswer, Orphan, Resends, twin_key
from backend.port.route import Route
from backend.port.request_log import RequestLog
from backend.port.request_body import (BodyBudget, ClientGone, Parsed, check_body, name_model,
                                       read_body)
from backend.settings import Settings
from backend.port.sse import StreamKind
from backend.llama.load import Serving, Snapshot, State
from backend.port.upstream_http import UpstreamClient

__all__ = ["GATED_ROUTES", "GatewayContext", "create_app"]

log = logging.getLogger("gguf_studio.gateway")

#: Gated route -> the framing of its streams (None: never streams).
GATED_ROUTES: dict[str, StreamKind | None] = {
    CHAT: StreamKind.CHAT,
    COMPLETIONS: StreamKind.CHAT,
    RESPONSES: StreamKind.RESPONSES,
    MESSAGES: StreamKind.MESSAGES,
    EMBEDDINGS: None,
}
OPEN_ROUTES = (MODELS, HEALTH, METRICS)
KNOWN_ROUTES = frozenset(GATED_ROUTES) | frozenset(OPEN_ROUTES) | {REQUESTS}
#: Answered without the key when one is set (for probes); see `backend.port.access_guard`.
KEYLESS_ROUTES = (HEALTH,)
#: What a 404 names, in this order.
_ANSWERED = (CHAT, RESPONSES, COMPLETIONS, MESSAGES, EMBEDDINGS, MODELS, HEALTH, METRICS, REQUESTS)
#: Set in the scope when the client went away before an answer could be sent.
_GONE = "gguf_studio.client_gone"


class GatewayContext(Protocol):
    settings: Settings  # read per request: it may change while the port runs
    registry: AdmissionRegistry
    metrics: Metrics
    #: The request inspector's ring: every gated request that ended leaves a record.
    requests: RequestLog
    #: The secret of the window's Chat tab (its own flow; "" for none).
    chat_secret: str

    @property
    def parking(self) -> PrefixSteward | None:
        """Restores sessions' parked prefixes before their turns (None: nothing is parked)."""

    @property
    def keys(self) -> KeyStore | None:
        """Named keys; None when the port has none (the owner's key alone)."""

    @property
    def flows(self) -> FlowControl: ...

    def snapshot(self) -> Snapshot:
        """The default model's engine."""

    def route(self, path: str, requested: object) -> Route:
        """Where a request for `path` naming model `requested` goes, with no side effect.
        Raises ModelNotFound or ModelNotReady."""

    def model_cards(self) -> list[ModelCard]:
        """Every model served or loadable, for /v1/models and /health."""

    def engines_elsewhere(self) -> list[dict[str, Any]]:
        """Every engine elsewhere, serving or not, for /health: "upstream N", never its
        address (which may carry a key) nor its key."""


class Gateway:
    """The app's state: the context, one shared upstream client, the handlers."""

    def __init__(self, ctx: GatewayContext, enrolment: EnrolmentEndpoint | None = None) -> None:
        self.ctx = ctx
        self.enrolment = enrolment
        self.guard = AccessGuard(lambda: ctx.settings, json_paths=GATED_ROUTES,
                                 keyless_paths=KEYLESS_ROUTES + (ENROLMENTS,), keys=lambda: ctx.keys,
                                 chat_secret=lambda: ctx.chat_secret)
        self.closing = False
        self.started_at = int(time.time())
        self._client: UpstreamClient | None = None
        # Running exchanges, so that a load going away can end them (see `abort_load`).
        self._running: set[Exchange] = set()
        #: Admits each request with one question (its hint, blocks and plan), and
        #: plans one that waited for its model's load.
        self.planner = RequestPlanner(ctx.registry, ctx.registry.sessions, self._tokenizer,
                                      lambda: ctx.settings)
        #: The ASGI app that `backend.port.server` serves.
        self.app = _starlette_app(self)
        #: Bodies being read, parsed and counted (before any queue bound holds them).
        self.incoming = BodyBudget(lambda: ctx.settings.max_incoming_body_bytes)
        ctx.requests.in_flight = lambda: [in_flight_record(e) for e in list(self._running)]
        #: Requests whose client left before their answer began, for their resends.
        self.resends = Resends(lambda: ctx.settings.resend_grace)

    @property
    def metrics(self) -> Metrics:
        return self.ctx.metrics

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    @property
    def client(self) -> UpstreamClient:
        if self._client is None:
            # No read/write limit: a generation may be silent for minutes (prompt
            # processing), and admission already bounds the number of requests.  It never
            # goes through a proxy.  See backend/port/upstream_http.py for why not httpx here.
            self._client = UpstreamClient(connect_timeout=10.0, max_idle=256)
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.aclose()

    def abort_load(self, key: str, error: RequestError) -> int:
        """End every request admitted on the engine with admission key `key` with `error`
        (an in-stream error, or an HTTP answer if nothing was sent yet) and close its
        upstream request: the engine then has nothing left to finish and stops at once."""
        return sum(exchange.abort(key, error) for exchange in list(self._running))

    # --- auth ------------------------------------------------------------------------

    def check_key(self, scope: Scope) -> Caller:
        return self.guard.check_key(scope)

    @property
    def flows(self) -> FlowControl:
        return self.ctx.flows

    @property
    def requests(self) -> RequestLog:
        return self.ctx.requests

    @property
    def parking(self) -> PrefixSteward | None:
        return self.ctx.parking

    @property
    def sessions(self) -> Sessions:
        """The session book, which each request's settlement tells once."""
        return self.ctx.registry.sessions

    # --- gated routes ----------------------------------------------------------------

    async def handle_gated(self, scope: Scope, receive: Receive, send: Send,
                           path: str) -> ModelCounts:
        """Answer one gated request; returns the counts it belongs to (its model, once
        resolved; the engine it was admitted on, if it was)."""
        arrived = time.monotonic()
        ctx = self.ctx
        settings = ctx.settings
        metrics = ctx.metrics
        headers = scope["headers"]
        traceparent = _traceparent(headers) if self.requests.exporter is not None else None
        # Until the request waits in line or runs, its body (read, parsed, counted) is
        # held against the port's budget of incoming bodies.
        hold = self.incoming.hold()
        caller: Caller | None = None
        model = UNROUTED  # until resolved: never the client's string
        served: asyncio.Future[None] | None = None  # its wait for a model load
        try:
            caller = self.check_key(scope)
            scope[KEY_NAME] = caller.name
            try:
                raw = await read_body(receive, headers, settings.effective_max_body_bytes(),
                                      settings.header_timeout, hold)
            except ClientGone:
                scope[_GONE] = True
                return metrics.of(model, UNROUTED)
            parsed = await check_body(path, raw, settings.max_output_tokens)
            raw_size = len(raw)
            del raw  # a capped body was re-encoded: hold one copy while waiting, not two
            route = ctx.route(path, parsed.data.get("model"))
            model = route.model
            # The key's limits first: a request refused for them loads and evicts nothing.
            passage = self.flows.enter(caller, model)
            flow = passage.flow
            asked = requested_band(headers)  # only ever lower than its key's
            band = flow.band if asked is None else max(asked, flow.band)
            line = ctx.registry.line(model)
            if not line.engines:  # it loads: its wait is checked before it starts one
                self.flows.check_spent(caller)
                line.check_wait(len(parsed.body), settings.max_waiting_body_bytes)
            route.serve(band)
            if not line.engines:
                served = line.when_served(size=len(parsed.body), flow=flow.key,
                                          max_waiting_bytes=settings.max_waiting_body_bytes)
            if route.named and parsed.model != model:
                # The name this port resolved and allowed, never the client's spelling.
                name_model(parsed, model)
            if (GATED_ROUTES[path] is not None and route.isolated
                    and parsed.data.get("cache_prompt") is not False):
                # Else a client's `cache_prompt: true` reuses another request's prompt.
                parsed.data["cache_prompt"] = False
                parsed.body = json.dumps(parsed.data, ensure_ascii=False,
                                         separators=(",", ":")).encode()
            twin = resent = None
            if self.resends:  # a request whose client left may be this one's twin
                twin = twin_key(caller.flow, path, model, headers, parsed.body)
                resent = self.resends.answer(twin) or self.resends.orphan(twin)
            if resent is not None:
                if served is not None:
                    served.cancel()
            else:
                admission = await self.planner.admit(line, path, model, caller.flow, headers,
                                                     parsed.data, raw_size)
            if resent is None and admission.plan is not None:
                # Planned: the parsed objects (several times the body's bytes) are not
                # kept by a waiting request, only the body (max_waiting_body_bytes).
                parsed.data = {}
            # Else the model is loading: the exchange waits for it, then plans.
        except RequestError as error:
            hold.release()  # before the answer: a client that got its 429 finds room
            if served is not None:
                served.cancel()
            if caller is not None:
                self.flows.refused(caller, error)
                self.requests.add(traceparent=traceparent,
                                  time=time.time() - (time.monotonic() - arrived), route=path,
                                  key=caller.name, model=None if model == UNROUTED else model,
                                  status=error.status, error=error.code)
            counts = metrics.of(model, UNROUTED)
            await http_errors.send_http_error(send, error, counts)
            return counts
        finally:
            hold.release()

        extensions = scope.get("extensions", {})
        if resent is not None:
            return await self._resent(resent, scope, send, receive, path, caller.name, model,
                                      stream=parsed.stream)
        exchange = Exchange(self, line, GatedRequest(path, GATED_ROUTES[path] or StreamKind.CHAT,
                                                     parsed, model, passage, admission.plan,
                                                     raw_size, asked, served,
                                                     admission.hint, arrived, traceparent,
                                                     admission.blocks, headers),
                            send, receive,
                            abort_connection=extensions.get(ABORT_EXTENSION),
                            body_writer=extensions.get(BODY_WRITER_EXTENSION))
        self._running.add(exchange)
        try:
            await exchange.run()
        finally:
            self._running.discard(exchange)
        if exchange.client_gone or exchange.audience.listener is not exchange.first:
            scope[_GONE] = True  # its client left, whoever had the answer
        return exchange.metrics

    async def _resent(self, resent: Orphan | FinishedAnswer, scope: Scope, send: Send,
                      receive: Receive, path: str, key: str, model: str, *,
                      stream: bool) -> ModelCounts:
        """The same request again, after its client left (`backend.port.resends`): it
        joins the running one, or gets its finished answer as it was."""
        if isinstance(resent, FinishedAnswer):
            for message in resent.messages:
                await send(message)
            self.requests.add(time=time.time(), route=path, key=key, model=model,
                              stream=stream, joined=JOINED_FINISHED)
            return self.metrics.of(model, UNROUTED)
        extensions = scope.get("extensions", {})
        if not await resent.adopt(Listener(send, receive,
                                           writer=extensions.get(BODY_WRITER_EXTENSION),
                                           abort=extensions.get(ABORT_EXTENSION))):
            scope[_GONE] = True
        return resent.metrics

    def _tokenizer(self, serving: Serving) -> HttpEngineTokenizer:
        """The tokenizer of a serving engine, for its need planner's counter.  No idle
        connection is kept to the engine for counting: llama-server waits for its open
        connections before it stops, which would slow every reload."""
        return HttpEngineTokenizer(serving.base_url, api_key=serving.api_key,
                                   client=self.client, headers={"Connection": "close"})

    def recheck(self, caller: Caller) -> None:
        """Raise the refusal of the caller's named key as the store has it now (revoked,
        expired, deleted): a request that waited for a model load is checked again."""
        keys = self.ctx.keys
        record = caller.key
        if keys is None or record is None or record.is_owner:
            return
        now = keys.get(record.name)
        refusal = (KeyRevoked(f"The API key {record.name!r} no longer exists.") if now is None
                   else now.refusal(time.time()))
        if refusal is not None:
            raise refusal

    # --- open routes -----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self.check_key(request.scope)
        data = model_list(self.ctx.model_cards(), self.started_at)
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        """`backend.port.health`: all of it for whoever may read it (`_may_read_health`)."""
        body, status = health_answer(self.ctx, self.enrolment,
                                     lambda: self._may_read_health(request.scope))
        return JSONResponse(body, status_code=status)

    def _may_read_health(self, scope: Scope) -> bool:
        """All of /health: on a port without keys, from this machine, or with a key."""
        keys = self.ctx.keys
        if not self.settings.api_key and not (keys is not None and keys.requires_keys()):
            return True
        if _from_loopback(scope):
            return True
        try:
            self.check_key(scope)
        except RequestError:
            return False
        return True

    async def requests_endpoint(self, request: Request) -> Response:
        """The inspector's records after `?after=ID` (the newest `?limit=N`): every one
        for the owner's key (or this machine's clients on a port without keys), a named
        key's own for that key (without the shared cache's figures), none for anyone
        else.  The Chat tab's secret is the owner's on models but reads like a named key:
        its own records (it needs no others, and a leaked one must not show everyone's)."""
        caller = self.check_key(request.scope)
        after = _whole_param(request, "after", 0)
        limit = _whole_param(request, "limit", 0)
        ring = self.requests
        key = caller.key
        if key is not None and key.name != OWNER_NAME:
            records = ring.records(after=after, key=key.name, limit=limit)
            under_way = ring.under_way(key=key.name)
        elif key is not None or _from_loopback(request.scope):
            records = ring.records(after=after, limit=limit)
            under_way = ring.under_way()
        else:
            records = under_way = []
        return JSONResponse({"object": "list", "last_id": ring.last_id,
                             "data": [record.to_dict() for record in records],
                             "in_flight": [record.to_dict() for record in under_way]})

    async def metrics_endpoint(self, request: Request) -> Response:
        self.check_key(request.scope)
        body, content_type = self.ctx.metrics.render()
        return Response(body, media_type=content_type)

    # --- errors raised inside Starlette ------------------------------------------------

    async def on_http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers or {})
        error: RequestError
        if exc.status_code == 404:
            error = NotFound(f"Unknown path. This server answers {', '.join(_ANSWERED[:-1])} "
                             f"and {_ANSWERED[-1]}.")
        elif exc.status_code == 405:
            allowed = headers.get("Allow", "")
            error = MethodNotAllowed(f"Method {request.method} is not allowed here."
                                     + (f" Use {allowed}." if allowed else ""))
        else:
            error = InvalidRequest("The request could not be handled.")
            error.status = exc.status_code
        return http_errors.error_response(error, self.ctx.metrics, extra_headers=headers)

    async def on_request_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        extra = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        return http_errors.error_response(exc, self.ctx.metrics, extra_headers=extra)


def not_ready_message(snapshot: Snapshot) -> str:
    if snapshot.restarting:
        return "The model is restarting. Try again shortly."
    if snapshot.state is State.STARTING:
        return "The model is loading. Try again shortly."
    if snapshot.state is State.READY:
        return "The model is being reloaded. Try again shortly."
    return "No model is loaded right now. Try again later."


class GatewayMiddleware:
    """Outermost app layer: access log, request counts, 426, 499 for a client that left
    before its answer (logged as that, no traceback), last-resort 500.

    Gated POSTs are dispatched here directly (no router walk, one send wrapper less per
    relayed chunk); everything else goes through Starlette's router.
    """

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await _refuse_websocket(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope["path"]
        method = scope["method"]
        metrics = self.gateway.ctx.metrics
        counts: Metrics | ModelCounts = metrics  # a gated request's are its model's
        try:
            screening = self.gateway.guard.screen(scope)  # Origin, Host, content type
            reply = screening.wrap(send_and_note)
            if screening.preflight:
                await screening.answer_preflight(send_and_note)
            elif path == RESPONSES and _is_websocket_upgrade(scope["headers"]):
                await http_errors.send_http_error(reply, UpgradeRequired(
                    "WebSocket is not supported here; use HTTP with streaming (SSE)."), metrics)
            elif method == "POST" and path in GATED_ROUTES:
                counts = await self.gateway.handle_gated(scope, receive, reply, path)
            else:
                await self.app(scope, receive, reply)
        except (ClientGone, ClientDisconnect):  # it left before its answer: nothing to say
            scope[_GONE] = True
        except Exception as exc:
            error = http_errors.as_request_error(exc)
            if not status:
                await http_errors.send_http_error(send_and_note, error, metrics)
        finally:
            if scope.get(_GONE):
                status = 499  # it left before its answer's end: as its record says
            elif not status:
                status = 500
            route = path if path in KNOWN_ROUTES else "other"
            counts.count_request(route, status)
            log_request(scope, status, (time.perf_counter() - started) * 1000)


def _is_websocket_upgrade(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"upgrade" and b"websocket" in value.lower():
            return True
    return False


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """Only under a server that speaks WebSocket (ours is started with ws='none')."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        status, headers, body = http_errors.http_error(UpgradeRequired(
            "WebSocket is not supported here; use HTTP with streaming (SSE)."), None)
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


class _GatedEndpoint:
    """The gated route as a plain ASGI app (reached only if the middleware is bypassed)."""

    def __init__(self, gateway: Gateway, path: str) -> None:
        self.gateway = gateway
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gateway.handle_gated(scope, receive, send, self.path)


def create_app(ctx: GatewayContext, enrolment: EnrolmentEndpoint | None = None) -> Gateway:
    """The port for `ctx`: the gateway, whose `app` the server serves; `enrolment`
    answers teammates asking for a key (backend.port.enrolment_endpoint)."""
    return Gateway(ctx, enrolment)


def _starlette_app(gateway: Gateway) -> Starlette:
    routes = [routing.Route(path, _GatedEndpoint(gateway, path), methods=["POST"])
              for path in GATED_ROUTES]
    routes += [
        routing.Route(MODELS, gateway.models, methods=["GET"]),
        routing.Route(HEALTH, gateway.health, methods=["GET"]),
        routing.Route(METRICS, gateway.metrics_endpoint, methods=["GET"]),
        routing.Route(REQUESTS, gateway.requests_endpoint, methods=["GET"]),
    ]
    if gateway.enrolment is not None:
        routes += [routing.Route(ENROLMENTS, gateway.enrolment.create, methods=["POST"]),
                   routing.Route(ENROLMENTS + "/{token}", gateway.enrolment.poll,
                                 methods=["GET"])]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(GatewayMiddleware, gateway=gateway)],
        exception_handlers={HTTPException: gateway.on_http_exception,
                            RequestError: gateway.on_request_error},
        lifespan=gateway.lifespan,
    )
    app.router.redirect_slashes = False
    return app


def _traceparent(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's W3C `traceparent` header (checked by the propagator that reads it)."""
    for name, value in headers:
        if name == b"traceparent":
            return value.decode("latin-1")[:128]
    return None


def _whole_param(request: Request, name: str, default: int) -> int:
    """A whole-number query parameter (InvalidRequest when it is not one)."""
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    if not text.isdigit() or len(text) > 18:
        raise InvalidRequest(f"{name} is a whole number, at least 0.", param=name)
    return int(text)


def _from_loopback(scope: Scope) -> bool:
    host = str((scope.get("client") or ("", 0))[0])
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)
