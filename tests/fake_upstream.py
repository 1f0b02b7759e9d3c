"""A small llama-server look-alike, for exact timings and injected faults.

It exists because a real llama-server cannot give either deterministically: here a
stream produces exactly `n_tokens` chunks, one every `delay` seconds, and can be told to
die after k chunks (the connection is cut mid-body, like a killed engine), to hang, or to
answer with an error.  Tests that need the real engine's behaviour (slots, tokenizer,
templates) use the real llama-server instead.  The benchmark uses it too, on its fast
path (no delay), to measure the port's own cost.

Endpoints, in llama-server's shapes: `GET /health` (503 while `loading`), `GET /props`
(`total_slots`, `default_generation_settings.n_ctx`), `GET /slots`, `GET /v1/models`,
`POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/messages`,
`/v1/embeddings`, streamed (`"stream": true`) or not; and the routes the port counts
prompts with (`/v1/chat/completions/input_tokens`, `/v1/responses/input_tokens`,
`/v1/messages/count_tokens`, `/apply-template`, `/tokenize`), with plausible counts:
one token per 4 bytes of text (rounded up), a ChatML-like template (4 tokens per
message, 3 for the generation prompt) and a BOS.  Those are recorded in `counted`, not
in `requests`; `count_gate` (an Event) holds their answers until it is set.

Behaviour is set on the `FakeUpstream` object (defaults for every request) and can be
overridden per request with a `"fake"` object in the JSON body, e.g.
`{"fake": {"delay": 0.05, "n_tokens": 100, "die_after": 3}}`:

- `prompt_delay`: silence before the first event (llama-server reading a long prompt);
- `n_tokens`, `delay`: the length and pace of a reply (capped by the request's output
  limit, read as llama-server reads it: the first of `n_predict`, `max_completion_tokens`,
  `max_tokens` given, a Responses `max_output_tokens` standing for `max_tokens`, an
  Anthropic message's `max_tokens` alone (4,096 when absent), -1 for none; the final
  chunk's finish_reason says "length" when the limit cut it, else "stop");
- `die_after`: cut the connection after that many content chunks;
- `hang`: send headers, then nothing, until the client goes away;
- `status` (+ `error_type`, `message`): answer with that error status instead.

Every request is recorded in `requests` (path and parsed body); streams whose client
went away before the end are counted in `disconnects`.

Like llama-server, it can hold a request that finds every slot busy until one frees
(`enforce_slots`, `--enforce-slots`; off by default, when any number run at once): a
benchmark that routes over several engines then sees a wrongly routed request wait, as
it would on a real engine.  `waited` counts the requests that had to wait, `peak_active`
the most that ran at once (both also in `GET /fake/stats`).

With `studio_health` set it answers `/health` (and lists `/v1/models`) as another GGUF
Studio port with several models would, in states a test sets by hand (a model failing
or leaving there at an exact moment).

Run on its own: `python -m tests.fake_upstream --port 8081 --slots 4 --delay 0.02`
(`--n-ctx` sets the per-slot context `/props` reports, which an attached port takes as
its KV cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["FakeUpstream", "InjectedFault", "Received"]

MODEL_PATH = "/srv/models/secret-dir/fake-model.gguf"


class InjectedFault(Exception):
    """Raised inside a streamed body to cut the connection mid-response."""


class _QuietFaults(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, InjectedFault):
                return False
            exc = exc.__cause__ or exc.__context__ or (
                exc.exceptions[0] if isinstance(exc, BaseExceptionGroup) and exc.exceptions else None)
        return True


_quiet = _QuietFaults()


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Plan:
    n_tokens: int
    delay: float
    die_after: int | None
    hang: bool
    status: int | None
    error_type: str
    message: str
    prompt_delay: float = 0.0  # silence before the first event, like prompt processing
    cut: bool = False  # the request's token limit shortened the reply


class FakeUpstream:
    def __init__(self, *, slots: int = 2, n_ctx: int = 4096, model: str = "fake-model",
                 n_tokens: int = 8, delay: float = 0.0, loading: bool = False,
                 enforce_slots: bool = False) -> None:
        self.slots = slots
        self.enforce_slots = enforce_slots
        self.n_ctx = n_ctx
        self.model = model
        self.n_tokens = n_tokens
        self.delay = delay
        self.loading = loading
        # Defaults for faults, overridable per request.
        self.die_after: int | None = None
        self.hang = False
        self.status: int | None = None
        self.requests: list[Received] = []
        self.counted: list[Received] = []  # prompt counting calls (input_tokens, tokenize, ...)
        #: While set to an unset Event, the counting routes record the call and answer
        #: only once it is set (a count's round trip held open for exact timing).
        self.count_gate: asyncio.Event | None = None
        #: While set to an unset Event, a stream holds its very last frame (`[DONE]`)
        #: until it is set: a reply whose final event is out but whose stream is not over.
        self.end_gate: asyncio.Event | None = None
        #: When set, a streamed chat's final chunk carries these `timings`, as
        #: llama-server's does (its `cache_n` and `prompt_n`: what its cache held).
        self.timings: dict[str, Any] | None = None
        self.active = 0
        self.peak_active = 0
        self.waited = 0  # requests that found every slot busy (enforce_slots)
        self._free_slots: asyncio.Semaphore | None = None
        self.disconnects = 0
        self.completed = 0
        #: When set, it answers as another GGUF Studio port would: `/health` is this body
        #: (its `models` listed in `/v1/models` too), whatever the model it names.
        self.studio_health: dict[str, Any] | None = None
        self.app = self._build_app()
        self._server: Any = None
        self.port = 0

    # --- serving -----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> "FakeUpstream":
        from backend.port.server import GatewayServer, PlainApp

        logging.getLogger("uvicorn.error").addFilter(_quiet)
        self._server = await GatewayServer.start(PlainApp(self.app), host, port, shutdown_grace=1.0)
        self.port = self._server.port
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
            self._server = None

    async def __aenter__(self) -> "FakeUpstream":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def received(self, path: str) -> list[dict[str, Any]]:
        return [r.body for r in self.requests if r.path == path]

    # --- the app -------------------------------------------------------------------------

    def _build_app(self) -> Starlette:
        routes = [
            Route("/health", self._health),
            Route("/props", self._props),
            Route("/slots", self._slots),
            Route("/v1/models", self._models),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/responses", self._responses, methods=["POST"]),
            Route("/v1/messages", self._messages, methods=["POST"]),
            Route("/v1/embeddings", self._embeddings, methods=["POST"]),
            Route("/v1/chat/completions/input_tokens", self._input_tokens, methods=["POST"]),
            Route("/v1/responses/input_tokens", self._input_tokens, methods=["POST"]),
            Route("/v1/messages/count_tokens", self._input_tokens, methods=["POST"]),
            Route("/apply-template", self._apply_template, methods=["POST"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/fake/stats", self._stats),  # not llama-server's: for the benchmark
        ]
        return Starlette(routes=routes)

    async def _health(self, request: Request) -> Response:
        if self.studio_health is not None:
            return JSONResponse(self.studio_health)
        if self.loading:
            return _error(503, "unavailable_error", "Loading model")
        return JSONResponse({"status": "ok"})

    async def _props(self, request: Request) -> Response:
        return JSONResponse({"total_slots": self.slots, "model_alias": self.model,
                             "model_path": MODEL_PATH,
                             "default_generation_settings": {"n_ctx": self.n_ctx}})

    async def _stats(self, request: Request) -> Response:
        return JSONResponse({"requests": len(self.requests), "counted": len(self.counted),
                             "waited": self.waited, "peak_active": self.peak_active})

    async def _slots(self, request: Request) -> Response:
        return JSONResponse([{"id": i, "is_processing": i < self.active} for i in range(self.slots)])

    async def _models(self, request: Request) -> Response:
        if self.studio_health is not None:
            return JSONResponse({"object": "list", "data": [
                {"id": m["id"], "object": "model", "context_length": m.get("context_length")}
                for m in self.studio_health.get("models", [])]})
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "llamacpp",
             "meta": {"n_ctx_train": self.n_ctx}}]})

    async def _begin(self, request: Request) -> tuple[dict[str, Any], _Plan] | Response:
        if self.loading:
            return _error(503, "unavailable_error", "Loading model")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "invalid_request_error", "bad json")
        self.requests.append(Received(request.url.path, body))
        over = body.get("fake") or {}
        limit = _limit(request.url.path, body)
        n = int(over.get("n_tokens", self.n_tokens))
        plan = _Plan(
            n_tokens=n if limit is None else min(n, limit),
            cut=limit is not None and limit < n,
            delay=float(over.get("delay", self.delay)),
            die_after=over.get("die_after", self.die_after),
            hang=bool(over.get("hang", self.hang)),
            status=over.get("status", self.status),
            error_type=over.get("error_type", "server_error"),
            message=over.get("message", "injected failure"),
            prompt_delay=float(over.get("prompt_delay", 0.0)),
        )
        if plan.status:
            return _error(int(plan.status), plan.error_type, plan.message)
        return body, plan

    # --- prompt counting -------------------------------------------------------------

    async def _counting_body(self, request: Request) -> dict[str, Any] | Response:
        if self.loading:
            return _error(503, "unavailable_error", "Loading model")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "invalid_request_error", "bad json")
        if not isinstance(body, dict):
            return _error(400, "invalid_request_error", "not an object")
        self.counted.append(Received(request.url.path, body))
        if self.count_gate is not None:
            await self.count_gate.wait()
        return body

    async def _input_tokens(self, request: Request) -> Response:
        body = await self._counting_body(request)
        if isinstance(body, Response):
            return body
        return JSONResponse({"input_tokens": _chat_tokens(body)})

    async def _apply_template(self, request: Request) -> Response:
        body = await self._counting_body(request)
        if isinstance(body, Response):
            return body
        turns = "".join(f"<|im_start|>{m.get('role', 'user')}\n{_texts(m.get('content'))}<|im_end|>\n"
                        for m in body.get("messages") or [] if isinstance(m, dict))
        return JSONResponse({"prompt": turns + "<|im_start|>assistant\n"})

    async def _tokenize(self, request: Request) -> Response:
        body = await self._counting_body(request)
        if isinstance(body, Response):
            return body
        n = _text_tokens(str(body.get("content", ""))) + (1 if body.get("add_special") else 0)
        return JSONResponse({"tokens": list(range(n))})

    # --- generation ------------------------------------------------------------------

    async def _events(self, plan: _Plan, frames: list[bytes], final: list[bytes]) -> AsyncIterator[bytes]:
        """`frames` one per token with the plan's pace and faults, then `final`."""
        await self._take_slot()
        finished = died = False
        try:
            if plan.hang:
                await asyncio.Event().wait()
            if plan.prompt_delay:
                await asyncio.sleep(plan.prompt_delay)
            for index, frame in enumerate(frames):
                if plan.die_after is not None and index >= plan.die_after:
                    died = True
                    raise InjectedFault("cut the connection mid-stream")
                if plan.delay and index:  # the first event comes when the prompt is read
                    await asyncio.sleep(plan.delay)
                yield frame
            for index, frame in enumerate(final):
                if index == len(final) - 1 and self.end_gate is not None:
                    await self.end_gate.wait()
                yield frame
            finished = True
        finally:
            self._free_slot()
            if finished:
                self.completed += 1
            elif not died:
                self.disconnects += 1

    async def _take_slot(self) -> None:
        """A slot for one generation; with `enforce_slots`, wait (in arrival order) for
        one to free when all are busy."""
        if self.enforce_slots:
            if self._free_slots is None:
                self._free_slots = asyncio.Semaphore(self.slots)
            if self._free_slots.locked():
                self.waited += 1
            await self._free_slots.acquire()
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)

    def _free_slot(self) -> None:
        self.active -= 1
        if self._free_slots is not None:
            self._free_slots.release()

    async def _whole(self, plan: _Plan, make: Any) -> Response:
        """A non-streamed answer after the plan's total delay (or never, if it hangs)."""
        if plan.hang or plan.die_after is not None:
            frames = [b" "] * plan.n_tokens
            return StreamingResponse(self._events(plan, frames, [json.dumps(make()).encode()]),
                                     media_type="application/json")
        await self._take_slot()
        try:
            if plan.delay:
                await asyncio.sleep(plan.delay * plan.n_tokens)
        finally:
            self._free_slot()
        self.completed += 1
        return JSONResponse(make())

    async def _chat(self, request: Request) -> Response:
        begun = await self._begin(request)
        if isinstance(begun, Response):
            return begun
        body, plan = begun
        cid = f"chatcmpl-{time.monotonic_ns()}"
        created = int(time.time())
        reason = "length" if plan.cut else "stop"
        if not body.get("stream"):
            return await self._whole(plan, lambda: {
                "id": cid, "object": "chat.completion", "created": created, "model": self.model,
                "choices": [{"index": 0, "finish_reason": reason, "message": {
                    "role": "assistant", "content": _text(plan.n_tokens)}}],
                "usage": _usage(plan.n_tokens)})

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            return _data({"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
                          "created": created, "id": cid, "model": self.model,
                          "system_fingerprint": "b0-fake", "object": "chat.completion.chunk",
                          **extra})

        frames = [chunk({"role": "assistant", "content": None})] if plan.n_tokens else []
        frames += [chunk({"content": f"tok{i} "}) for i in range(plan.n_tokens)]
        options = body.get("stream_options")
        usage: dict[str, Any] = ({"usage": _usage(plan.n_tokens)}
                                 if isinstance(options, dict) and options.get("include_usage")
                                 else {})
        if self.timings is not None:
            usage["timings"] = self.timings
        final = [chunk({}, reason, **usage), b"data: [DONE]\n\n"]
        return _sse(self._events(plan, frames, final))

    async def _completions(self, request: Request) -> Response:
        begun = await self._begin(request)
        if isinstance(begun, Response):
            return begun
        body, plan = begun
        cid = f"cmpl-{time.monotonic_ns()}"
        reason = "length" if plan.cut else "stop"
        if not body.get("stream"):
            return await self._whole(plan, lambda: {
                "id": cid, "object": "text_completion", "model": self.model,
                "choices": [{"index": 0, "text": _text(plan.n_tokens), "finish_reason": reason}],
                "usage": _usage(plan.n_tokens)})

        def chunk(text: str, finish: str | None = None) -> bytes:
            return _data({"id": cid, "object": "text_completion", "model": self.model,
                          "choices": [{"index": 0, "text": text, "finish_reason": finish}]})

        frames = [chunk(f"tok{i} ") for i in range(plan.n_tokens)]
        return _sse(self._events(plan, frames, [chunk("", reason), b"data: [DONE]\n\n"]))

    async def _responses(self, request: Request) -> Response:
        begun = await self._begin(request)
        if isinstance(begun, Response):
            return begun
        body, plan = begun
        rid = f"resp_upstream{time.monotonic_ns()}"
        mid = f"msg_upstream{time.monotonic_ns()}"
        text = _text(plan.n_tokens)
        item = {"type": "message", "status": "completed", "id": mid, "role": "assistant",
                "content": [{"type": "output_text", "annotations": [], "text": text}]}
        done = {"id": rid, "object": "response", "created_at": int(time.time()),
                "status": "completed", "model": self.model, "output": [item],
                "usage": {"input_tokens": 3, "output_tokens": plan.n_tokens,
                          "total_tokens": 3 + plan.n_tokens}}
        if not body.get("stream"):
            return await self._whole(plan, lambda: done)
        stub = {"id": rid, "object": "response", "status": "in_progress"}
        head = (_event("response.created", {"type": "response.created", "response": stub})
                + _event("response.in_progress", {"type": "response.in_progress", "response": stub}))
        frames = [head + _event("response.output_item.added", {
            "type": "response.output_item.added", "item": {
                "content": [], "id": mid, "role": "assistant", "status": "in_progress",
                "type": "message"}})]
        frames += [_event("response.output_text.delta", {
            "type": "response.output_text.delta", "item_id": mid, "delta": f"tok{i} "})
            for i in range(plan.n_tokens)]
        final = [
            _event("response.output_text.done", {"type": "response.output_text.done",
                                                 "item_id": mid, "text": text}),
            _event("response.output_item.done", {"type": "response.output_item.done", "item": item}),
            _event("response.completed", {"type": "response.completed", "response": done}),
        ]
        return _sse(self._events(plan, frames, final))

    async def _messages(self, request: Request) -> Response:
        begun = await self._begin(request)
        if isinstance(begun, Response):
            return begun
        body, plan = begun
        mid = f"msg_{time.monotonic_ns()}"
        reason = "max_tokens" if plan.cut else "end_turn"
        message = {"id": mid, "type": "message", "role": "assistant", "model": self.model,
                   "content": [{"type": "text", "text": _text(plan.n_tokens)}],
                   "stop_reason": reason, "usage": {"input_tokens": 3,
                                                    "output_tokens": plan.n_tokens}}
        if not body.get("stream"):
            return await self._whole(plan, lambda: message)
        start = dict(message, content=[], stop_reason=None)
        frames = [_event("message_start", {"type": "message_start", "message": start})
                  + _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                   "content_block": {"type": "text", "text": ""}})]
        frames += [_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                  "delta": {"type": "text_delta", "text": f"tok{i} "}})
                   for i in range(plan.n_tokens)]
        final = [_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                 _event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason},
                                          "usage": {"output_tokens": plan.n_tokens}}),
                 _event("message_stop", {"type": "message_stop"})]
        return _sse(self._events(plan, frames, final))

    async def _embeddings(self, request: Request) -> Response:
        begun = await self._begin(request)
        if isinstance(begun, Response):
            return begun
        body, plan = begun
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        return await self._whole(plan, lambda: {
            "object": "list", "model": self.model,
            "data": [{"object": "embedding", "index": i, "embedding": [0.0, 0.5, 1.0]}
                     for i in range(len(inputs))],
            "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}})


# --- helpers ---------------------------------------------------------------------------


def _limit(path: str, body: dict[str, Any]) -> int | None:
    """The output limit llama-server obeys: not the smallest field, the first it reads
    (tools/server/server-schema.cpp, server-chat.cpp)."""
    if path == "/v1/messages":  # the Anthropic conversion keeps max_tokens alone
        names: tuple[str, ...] = ("max_tokens",)
    elif path == "/v1/responses" and "max_output_tokens" in body:  # becomes max_tokens
        names = ("n_predict", "max_completion_tokens", "max_output_tokens")
    else:
        names = ("n_predict", "max_completion_tokens", "max_tokens")
    for name in names:
        value = body.get(name)
        if value is not None:
            return None if value == -1 else int(value)
    return 4096 if path == "/v1/messages" else None


def _text_tokens(text: str) -> int:
    """Plausible BPE-like count: one token per 4 bytes, rounded up."""
    return (len(text.encode()) + 3) // 4


def _texts(value: Any) -> str:
    """Every string inside `value` (content parts, tool schemas), joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(_texts(v) for v in value)
    if isinstance(value, dict):
        return " ".join(_texts(v) for v in value.values())
    return ""


def _chat_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a chat, Responses or messages body under a ChatML-like template:
    BOS, 4 per message or input item, the texts, the tools, 3 for the generation prompt."""
    given = body.get("input")
    turns = [*(body.get("messages") or []), *(given if isinstance(given, list) else [given]),
             body.get("system"), body.get("instructions")]
    turns = [t for t in turns if t]
    text = " ".join(_texts(t) for t in turns) + " " + _texts(body.get("tools"))
    return 1 + 4 * len(turns) + _text_tokens(text.strip()) + 3


def _text(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}


def _data(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _event(name: str, payload: Any) -> bytes:
    return b"event: " + name.encode() + b"\n" + _data(payload)


def _sse(body: AsyncIterator[bytes]) -> Response:
    return StreamingResponse(body, media_type="text/event-stream")


def _error(status: int, type_: str, message: str) -> Response:
    # llama-server's shape: an integer code; messages may carry internals (the gateway
    # must scrub them), so the injected ones do.
    return JSONResponse({"error": {"code": status, "message": message, "type": type_}},
                        status_code=status)


async def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--n-tokens", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--n-ctx", type=int, default=4096,
                        help="the per-slot context /props reports (4096)")
    parser.add_argument("--enforce-slots", action="store_true",
                        help="a request that finds every slot busy waits for one (as "
                             "llama-server does); by default any number run at once")
    args = parser.parse_args()
    fake = FakeUpstream(slots=args.slots, n_ctx=args.n_ctx, n_tokens=args.n_tokens,
                        delay=args.delay, enforce_slots=args.enforce_slots)
    await fake.start(args.host, args.port)
    print(f"fake llama-server on {fake.base_url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await fake.stop()


if __name__ == "__main__":
    try:
        asyncio.run(_main())
    except KeyboardInterrupt:
        pass
