"""Optional OpenTelemetry export of the request inspector's records (off by default).

With `settings.otel_endpoint` set (GGUF_STUDIO_OTEL_ENDPOINT, e.g.
`http://collector:4318/v1/traces`; the `otel` extra installs the SDK and its OTLP/HTTP
exporter), each request's record becomes one span when the request ends: a SERVER span
named "{operation} {model}" with the GenAI semantic conventions' attributes
(`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...)
and the inspector's own under `gguf_studio.*`.  A client's W3C `traceparent` header makes
it a child of the client's span.  Spans are made from the record once the request ended
and exported in batches from the SDK's own thread, so the relay's per-chunk work is
unchanged; when off, nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from backend.port.request_log import RequestRecord

__all__ = ["SpanExport", "span_export_to"]

#: `gen_ai.operation.name` by route.
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/messages": "chat", "/v1/responses": "chat",
              "/v1/completions": "text_completion", "/v1/embeddings": "embeddings"}
#: `gen_ai.provider.name`: what answers behind the port.
PROVIDER = "llama.cpp"


class SpanExport:
    """Turns records into spans and hands them to `exporter` (batched, off the loop;
    `batch=False` exports each at once, for tests)."""

    def __init__(self, exporter: SpanExporter, *, batch: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": "gguf-studio"}))
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("gguf_studio.port")
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)

    def __call__(self, record: RequestRecord, traceparent: str | None) -> None:
        """One span for `record`, from its arrival to now; a child of `traceparent`'s span
        when the client sent a valid one."""
        context = (self._propagator.extract({"traceparent": traceparent})
                   if traceparent else None)
        operation = OPERATIONS.get(record.route, "chat")
        span = self._tracer.start_span(
            f"{operation} {record.model}" if record.model else operation, context=context,
            kind=self._server, start_time=int(record.time * 1e9),
            attributes=_attributes(record, operation))
        if record.error is not None or record.status >= 400:
            span.set_status(self._error)
        span.end(end_time=time.time_ns())

    def close(self) -> None:
        """Export what is pending, then stop."""
        self._provider.shutdown()


def span_export_to(endpoint: str) -> SpanExport:
    """Spans to an OTLP/HTTP collector at `endpoint` (ImportError without the extra)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return SpanExport(OTLPSpanExporter(endpoint=endpoint))


def _attributes(record: RequestRecord, operation: str) -> dict[str, Any]:
    pairs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": record.model,
        "gen_ai.response.model": record.model,
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
        "http.route": record.route,
        "http.response.status_code": record.status,
        "error.type": record.error,
        "gguf_studio.key": record.key,
        "gguf_studio.session": record.session,
        "gguf_studio.engine": record.engine,
        "gguf_studio.slot": record.slot,
        "gguf_studio.band": record.band,
        "gguf_studio.queue.wait_seconds": record.wait,
        "gguf_studio.queue.wait_reason": record.wait_reason,
        "gguf_studio.queue.waited_behind": record.waited_behind,
        "gguf_studio.prefill_ms": record.prefill_ms,
        "gguf_studio.time_to_first_token_seconds": record.time_to_first_token,
        "gguf_studio.tokens_per_second": record.tokens_per_second,
        "gguf_studio.longest_gap_seconds": record.longest_gap,
    }
    return {name: value for name, value in pairs.items() if value is not None}
