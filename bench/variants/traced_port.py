"""The port with timestamps along each request's way to its first token, to see which
part of an added time to first token is the port's own work and which is waiting on the
engine: `bench/pool.py --variant port-traced=bench/variants/traced_port.py --keep-logs`.

At exit it writes to its log (`port-traced.log`) the p50 / p90 / p99 of each step:

    in -> gated        request bytes read -> the gateway starts on it (HTTP parsing, the task)
    gated -> up_write  the gateway's work: key, body checks, plan, admission, forwarding
    up_write -> up_head, up_head -> up_first   the engine: its answer's head, its first token
    up_first -> out    the first token relayed to the client

The patches cost a few µs per request and per chunk; the figures are for this port, not
a measurement of the unpatched one beside it.
"""

from __future__ import annotations

import atexit
import contextvars
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backend.port import gateway, server, upstream_http  # noqa: E402

STEPS = ("in", "gated", "up_write", "up_head", "up_first", "out")
now = time.perf_counter
traces: list[dict[str, float]] = []
current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "trace", default=None)


def _patch() -> None:
    protocol = server._Protocol
    data_received, handle_events = protocol.data_received, protocol.handle_events

    def traced_data_received(self: Any, data: bytes) -> None:
        self.bench_read_at = now()
        data_received(self, data)

    def traced_handle_events(self: Any) -> None:
        handle_events(self)
        if self.scope is not None:
            self.scope.setdefault("bench_read_at", self.bench_read_at)

    protocol.data_received = traced_data_received  # type: ignore[method-assign]
    protocol.handle_events = traced_handle_events  # type: ignore[method-assign]

    handle_gated = gateway.Gateway.handle_gated

    async def traced_handle_gated(self: Any, scope: Any, receive: Any, send: Any,
                                  path: str) -> None:
        trace = {"in": scope.get("bench_read_at", now()), "gated": now()}
        traces.append(trace)
        current.set(trace)

        async def traced_send(message: dict[str, Any]) -> None:
            if ("out" not in trace and message["type"] == "http.response.body"
                    and b'"content":"' in message.get("body", b"")):
                trace["out"] = now()
            await send(message)

        await handle_gated(self, scope, receive, traced_send, path)

    gateway.Gateway.handle_gated = traced_handle_gated  # type: ignore[method-assign]

    connection = upstream_http._Connection
    start, upstream_data = connection.start, connection.data_received

    def traced_start(self: Any, payload: bytes) -> None:
        trace = current.get()
        if trace is not None:
            trace["up_write"] = now()
        self.bench_trace = trace
        start(self, payload)

    def traced_upstream_data(self: Any, data: bytes) -> None:
        trace = getattr(self, "bench_trace", None)
        if trace is not None:
            trace.setdefault("up_head", now())
            if "up_first" not in trace and b'"content":"' in data:
                trace["up_first"] = now()
        upstream_data(self, data)

    connection.start = traced_start  # type: ignore[method-assign]
    connection.data_received = traced_upstream_data  # type: ignore[method-assign]


def _report() -> None:
    whole = [t for t in traces if all(step in t for step in STEPS)]
    if not whole:
        return

    def quantiles(a: str, b: str) -> str:
        values = sorted(t[b] - t[a] for t in whole)
        return " / ".join(f"{values[int((len(values) - 1) * q)] * 1e3:.2f}"
                          for q in (0.5, 0.9, 0.99))

    print(f"traced {len(whole)} requests, p50 / p90 / p99 ms:", flush=True)
    for a, b in zip(STEPS, STEPS[1:]):
        print(f"traced {a:>8} -> {b:<8} {quantiles(a, b)}", flush=True)
    print(f"traced {'in':>8} -> {'out':<8} {quantiles('in', 'out')}", flush=True)


_patch()
atexit.register(_report)

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
