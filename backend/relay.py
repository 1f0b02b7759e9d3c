"""One admitted-or-waiting request, from its ticket to the last byte sent to the client.

`Exchange.run` waits for the ticket (sending keep-alives when the client streams),
forwards the request to the load the ticket was admitted on, and relays the answer.
Stream bytes are relayed as they come (`aiter_raw`), cut only at event boundaries; only
a `/v1/responses` stream has its head read, to keep one response id throughout.

Errors end the exchange through `backend.gateway_errors`: an HTTP answer while no
header was sent, a final in-stream error event afterwards.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator

import httpx

from backend import gateway_errors
from backend import sse
from backend.admission import Ticket
from backend.errors import (RETRY_SOON, LoadReplaced, ModelNotReady, RequestError, UpstreamFailed,
                            UpstreamUnavailable)

if TYPE_CHECKING:
    from backend.metrics import Metrics
    from backend.request_body import Parsed
    from backend.upstream_http import UpstreamClient, UpstreamResponse

__all__ = ["DisconnectWatch", "Exchange", "SSE_HEADERS"]

log = logging.getLogger("gguf_studio.gateway")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
#: How much of an upstream error body is read.
ERROR_BODY_LIMIT = 64 * 1024


class DisconnectWatch:
    """Cancels the request's task the moment its client disconnects.

    uvicorn's `send` stays silent after a disconnect, and a request that waits in line
    or for a slow upstream sends nothing for a long time: so one small task listens on
    `receive` (the body has been read already) and cancels the handler, which then
    leaves the line, or closes the upstream request and releases its slot, at once.
    `stop()` must be called before the final message of the response is sent, because
    `receive` reports a completed response as a disconnect too.
    """

    __slots__ = ("disconnected", "_stopped", "_task", "_watcher")

    def __init__(self, receive: Any) -> None:
        self.disconnected = False
        self._stopped = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not self._stopped and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    def stop(self) -> None:
        self._stopped = True
        if not self._watcher.done():
            self._watcher.cancel()


class Exchange:
    """A gated request with its ticket; `run()` answers every RequestError itself."""

    def __init__(self, *, client: UpstreamClient, metrics: Metrics, send: Any,
                 watch: DisconnectWatch, ticket: Ticket, path: str, kind: sse.StreamKind | None,
                 parsed: Parsed, model_id: str | None, queue_timeout: float,
                 keepalive_interval: float) -> None:
        self.client = client
        self.metrics = metrics
        self.send = send
        self.watch = watch
        self.ticket = ticket
        self.path = path
        self.kind = kind or sse.StreamKind.CHAT
        self.parsed = parsed
        self.model_id = model_id
        self.queue_timeout = queue_timeout
        self.keepalive_interval = keepalive_interval
        self.stage = "queued"
        self.headers_sent = False
        self.rewriter = sse.ResponsesRewriter(None) if self.kind is sse.StreamKind.RESPONSES else None
        self.framer = sse.EventFramer()
        self._keepalive = sse.KEEPALIVE_COMMENT

    # --- the whole exchange ---------------------------------------------------------

    async def run(self) -> None:
        """Wait, forward, answer.  The last messages go out after the upstream request is
        closed and the ticket released, so a client that has seen the end of its answer
        can count on its slot being free."""
        try:
            if not self.ticket.admitted:
                if self.parsed.stream:
                    await self._start_stream()
                    await self._wait_with_keepalives()
                else:
                    await self.ticket.wait(self.queue_timeout)
            self.stage = "running"
            ticket = self.ticket
            if ticket.admitted_at is not None:
                self.metrics.observe_queue_wait(ticket.admitted_at - ticket.enqueued_at)
            last = await self._forward()
        except RequestError as error:
            last = self._failure(error)
        except Exception as exc:  # a bug: a generic 500 / in-stream error, logged
            last = self._failure(gateway_errors.as_request_error(exc))
        await self._finish(last)

    async def shutdown(self, error: RequestError | None = None) -> None:
        """The port is closing, or the load is going away, under this exchange: end it
        cleanly while possible."""
        await self._finish(self._failure(
            error or ModelNotReady("The server is shutting down.", retry_after=RETRY_SOON)))

    async def _finish(self, messages: list[dict[str, Any]]) -> None:
        self.ticket.release()
        self.watch.stop()
        for message in messages:
            await self.send(message)

    def _failure(self, error: RequestError) -> list[dict[str, Any]]:
        """The last messages for `error`: an HTTP answer, or a final stream event."""
        if not self.headers_sent:
            status, headers, body = gateway_errors.http_error(error, self.metrics)
            self.headers_sent = True
            return [{"type": "http.response.start", "status": status, "headers": headers},
                    {"type": "http.response.body", "body": body, "more_body": False}]
        self.framer.drop()  # an incomplete event is never completed: leave it out
        response_id = self.rewriter.client_id if self.rewriter else None
        tail = gateway_errors.stream_error(error, self.metrics, kind=self.kind,
                                    response_id=response_id, model=self.model_id)
        return [{"type": "http.response.body", "body": tail, "more_body": False}]

    # --- waiting ----------------------------------------------------------------------

    async def _start_stream(self) -> None:
        """Headers, then at once something the client counts as life: our own
        `response.created` on the Responses wire, a comment elsewhere."""
        await self._send_stream_headers()
        if self.rewriter is not None:
            await self._send_response_created()
        else:
            # Bytes at once, not only after the first interval: the client (and any proxy
            # in between) sees a live stream from the start.
            await self.send({"type": "http.response.body", "body": sse.KEEPALIVE_COMMENT,
                             "more_body": True})

    async def _send_stream_headers(self) -> None:
        await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self.headers_sent = True

    async def _send_response_created(self) -> None:
        """Our `response.created`; from now on the upstream's own is dropped and its id
        replaced by ours, and keep-alives are `response.in_progress` events."""
        assert self.rewriter is not None
        our_id = sse.new_response_id()
        self.rewriter.our_id = our_id
        stub = sse.response_stub(our_id, self.model_id)
        created = sse.named_event("response.created",
                                  {"type": "response.created", "response": stub})
        self._keepalive = sse.named_event("response.in_progress",
                                          {"type": "response.in_progress", "response": stub})
        await self.send({"type": "http.response.body", "body": created, "more_body": True})

    async def _wait_with_keepalives(self) -> None:
        interval = self.keepalive_interval if self.keepalive_interval > 0 else None
        message = {"type": "http.response.body", "body": self._keepalive, "more_body": True}
        waiter = asyncio.ensure_future(self.ticket.wait(self.queue_timeout))
        try:
            while True:
                done, _ = await asyncio.wait((waiter,), timeout=interval)
                if done:
                    waiter.result()
                    return
                await self.send(message)
        finally:
            if not waiter.done():
                waiter.cancel()  # the ticket leaves the line (released by the caller too)
            elif not waiter.cancelled():
                waiter.exception()  # retrieved: no "never retrieved" noise

    # --- forwarding ------------------------------------------------------------------

    def _lost(self, error: RequestError) -> RequestError:
        """`error`, unless the load was replaced meanwhile: then say so."""
        if self.ticket.queue.retired:
            return LoadReplaced("The model was reloaded or unloaded while this request ran. "
                                "Send it again.", retry_after=RETRY_SOON)
        return error

    async def _forward(self) -> list[dict[str, Any]]:
        """Forward to the ticket's load; returns the last messages still to send."""
        request = self.client.build_request("POST", self.ticket.base_url + self.path,
                                            content=self.parsed.body, headers=UPSTREAM_HEADERS)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError:
            raise self._lost(UpstreamUnavailable(
                "The model server could not be reached. Try again shortly.",
                retry_after=RETRY_SOON)) from None
        try:
            if upstream.status_code >= 400:
                raise gateway_errors.upstream_error(upstream.status_code, await self._read_error(upstream))
            if self.parsed.stream:
                return await self._relay(upstream)
            return await self._answer(upstream)
        finally:
            await upstream.aclose()

    async def _read_error(self, upstream: UpstreamResponse) -> bytes:
        body = b""
        try:
            async for chunk in upstream.aiter_raw():
                body += chunk
                if len(body) > ERROR_BODY_LIMIT:
                    break
        except httpx.HTTPError:
            pass
        return body

    async def _answer(self, upstream: UpstreamResponse) -> list[dict[str, Any]]:
        try:
            body = await upstream.aread()
        except httpx.HTTPError:
            raise self._lost(UpstreamFailed(
                "The model server stopped while answering. Try again.")) from None
        content_type = upstream.headers.get("content-type", "application/json")
        self.headers_sent = True
        return [{"type": "http.response.start", "status": upstream.status_code,
                 "headers": [(b"content-type", content_type.encode("latin-1")),
                             (b"content-length", str(len(body)).encode())]},
                {"type": "http.response.body", "body": body, "more_body": False}]

    async def _relay(self, upstream: UpstreamResponse) -> list[dict[str, Any]]:
        send = self.send
        if not self.headers_sent:
            await self._send_stream_headers()
        framer = self.framer
        rewriter = self.rewriter
        chunks = upstream.aiter_raw()
        try:
            first = await self._first_chunk(chunks)
            if rewriter is None:
                chunk = framer.feed(first)
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                async for chunk in chunks:
                    chunk = framer.feed(chunk)
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                tail = framer.flush()
            else:
                chunk = rewriter.feed(framer.feed(first))
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                async for chunk in chunks:
                    chunk = framer.feed(chunk)
                    if chunk:
                        chunk = rewriter.feed(chunk)
                        if chunk:
                            await send({"type": "http.response.body", "body": chunk,
                                        "more_body": True})
                tail = rewriter.feed(framer.flush()) + rewriter.flush()
        except httpx.HTTPError:
            raise self._lost(UpstreamFailed(
                "The model server stopped while answering. Try again.")) from None
        return [{"type": "http.response.body", "body": tail, "more_body": False}]

    async def _first_chunk(self, chunks: AsyncIterator[bytes]) -> bytes:
        """The engine's first bytes, keeping the client alive meanwhile: llama-server sends
        nothing, not even `response.created`, until it has read the whole prompt, which
        takes longer than a client's idle timeout for a long conversation on a CPU."""
        interval = self.keepalive_interval if self.keepalive_interval > 0 else None
        first = asyncio.ensure_future(anext(chunks, b""))
        try:
            while True:
                done, _ = await asyncio.wait((first,), timeout=interval)
                if done:
                    return first.result()
                if self.rewriter is not None and self.rewriter.our_id is None:
                    await self._send_response_created()
                else:
                    await self.send({"type": "http.response.body", "body": self._keepalive,
                                     "more_body": True})
        finally:
            if not first.done():
                first.cancel()
