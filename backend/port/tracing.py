"""Optional OpenTelemetry export of the request inspector's records (off by default).

With `settings.otel_endpoint` set (GGUF_STUDIO_OTEL_ENDPOINT, e.g.
`http://collector:4318/v1/traces`; the `otel` extra installs the SDK and its OTLP/HTTP
exporter), each request's record becomes one span when the request ends: a SERVER span
named "{operation} {model}" with the GenAI semantic conventions' attributes
(`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...)
and the inspector's own under `gguf_studio.*`.  The port's span is always exported: the
export is the owner's record of the port, so a client's W3C `traceparent` flagged "not
sampled" hides nothing from it.  A client's valid `traceparent` is a *link* of the span,
which starts a trace of its own: a client on the LAN cannot put the owner's spans into a
trace it chose.  Only when the owner opts in (`settings.otel_client_parent`, for clients
the owner traces too) is the client's span the parent, so the request joins its trace.
Spans are made from the record once the request ended and exported in batches from a
thread of their own, so the relay's per-chunk work is unchanged; when off, nothing of
OpenTelemetry is imported.

What a span costs is measured by `bench/tracing.py` (target: at most 2 % of the relay's
CPU for a 200-token answer).  The SDK's own path costs ~8 % there: its tracer cleans
every attribute (~35 µs a span), its propagator ~17 µs a `traceparent`, its OTLP encoder
~75 µs a span in the exporter's thread.  So the loop only reads the `traceparent` (with
the propagator's own pattern) and queues the ended request (the ring's own frozen record
and three ints); this module's thread takes them in batches as the SDK's batch processor
does (its `OTEL_BSP_*` settings) and hands them on: to `OtlpHttpSpans` (the SDK's
OTLP/HTTP exporter: its endpoint, `OTEL_EXPORTER_OTLP_*` headers, TLS, compression and
retries) encoded straight into the OTLP message the SDK's encoder would write (~10 µs a
span, against ~75 for the SDK's encoder and ~9 to make its span), to any other exporter
as the SDK's `ReadableSpan`s (what a tracer hands its processors).  The garbage
collector is not what spans cost (bench/README.md: its runs and time are alike on and
off); the exporter's thread is.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from backend.api_paths import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, RESPONSES

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from backend.port.request_log import RequestRecord

    #: A client's span a span links to: (trace id, span id, trace flags).
    ClientSpan = tuple[int, int, int]
    #: An ended request waiting for its span (see `SpanExport._pending`).
    Ended = tuple[RequestRecord, int, int, ClientSpan | None, int]
    #: Its span's ids given: (record, trace id, span id, parent span id or 0, the client's
    #: span it links to or None, end in ns).
    Made = tuple[RequestRecord, int, int, int, ClientSpan | None, int]

__all__ = ["SpanExport", "otlp_request", "span_export_to"]

log = logging.getLogger(__name__)

#: `gen_ai.operation.name` by route.
OPERATIONS = {CHAT: "chat", MESSAGES: "chat", RESPONSES: "chat", COMPLETIONS: "text_completion",
              EMBEDDINGS: "embeddings"}
#: `gen_ai.provider.name`: what answers behind the port.
PROVIDER = "llama.cpp"

#: W3C trace context, as the SDK's `TraceContextTextMapPropagator` reads it.
TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$")


class SpanExport:
    """Turns records into spans and hands them to `exporter` in batches from a thread of
    its own (`batch=False`: each at once, on the caller's thread, for tests).  A client's
    span is the parent of a request's span while `client_parent()` says so, else a link."""

    def __init__(self, exporter: SpanExporter, *, batch: bool = True,
                 client_parent: Callable[[], bool] = lambda: False) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import (Link, SpanContext, SpanKind, Status, StatusCode,
                                         TraceFlags)

        self._exporter = exporter
        self._client_parent = client_parent
        self._link = Link
        self._flags = TraceFlags
        self._resource = Resource.create({"service.name": "gguf-studio"})
        self._scope = InstrumentationScope("gguf_studio.port")
        self._ids = RandomIdGenerator()
        self._span = ReadableSpan
        self._context = SpanContext
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)
        self._unset = Status(StatusCode.UNSET)
        # The OTLP message's parts around the spans (`otlp_request`'s), for `_encoded`.
        scope = self._scope
        self._scope_head = _field(1, _text(1, scope.name) + _text(2, scope.version or "")
                                  + _attribute_list(3, scope.attributes))
        self._scope_tail = _text(3, scope.schema_url or "")
        self._resource_head = _field(1, _attribute_list(1, self._resource.attributes))
        self._resource_tail = _text(3, self._resource.schema_url)
        #: Ended requests not yet exported: (record, parent trace id, parent span id, the
        #: client's span to link, end in ns), the record being the ring's own (frozen).
        self._pending: queue.SimpleQueue[Ended] = queue.SimpleQueue()
        self._closed = False
        self._thread: threading.Thread | None = None
        if batch:
            self._delay = _setting("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
            self._queue_size = _setting("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
            self._batch_size = min(_setting("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
                                   self._queue_size)
            self._wake = threading.Event()
            self._thread = threading.Thread(target=self._run, name="gguf-studio-spans",
                                            daemon=True)
            self._thread.start()

    def __call__(self, record: RequestRecord, traceparent: str | None) -> None:
        """One span for `record`, from its arrival to now, sampled or not by the client;
        linked to `traceparent`'s span when the client sent a valid one, or its child when
        the owner opted in."""
        if self._closed:
            return
        trace_id = parent_id = 0
        link = _client_span(traceparent) if traceparent else None
        if link is not None and self._client_parent():
            trace_id, parent_id, _ = link
            link = None
        ended = (record, trace_id, parent_id, link, time.time_ns())
        if self._thread is None:
            self._export([ended])
            return
        # Only the queue is touched here, the loop's CPU being the relay's: the span is
        # made (or encoded straight), and sent, on the exporter's thread.
        if self._pending.qsize() >= self._queue_size:
            return  # the SDK's processor drops spans past its queue's bound too
        self._pending.put(ended)
        if self._pending.qsize() >= self._batch_size:
            self._wake.set()

    def close(self) -> None:
        """Export what is pending, then stop."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join(30)
        self._exporter.shutdown()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._delay)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        while True:
            batch: list[Ended] = []
            while len(batch) < self._batch_size:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            if not batch:
                return
            try:
                self._export(batch)
            except Exception:  # an exporter that fails never stops the thread
                log.exception("exporting spans failed")

    def _export(self, batch: list[Ended]) -> None:
        """`batch` as the finished spans a tracer would hand its processors at `end()`
        (a tracer would clean each attribute; these are already clean: str, int, float),
        or, to `OtlpHttpSpans`, straight as the OTLP message of those spans."""
        generate_trace_id, generate_span_id = (self._ids.generate_trace_id,
                                               self._ids.generate_span_id)
        spans = [(record, trace_id or generate_trace_id(), generate_span_id(), parent_id, link,
                  end_time) for record, trace_id, parent_id, link, end_time in batch]
        send = getattr(self._exporter, "send_encoded", None)
        if send is not None:
            send(self._encoded(spans))
        else:
            self._exporter.export([self._readable(span) for span in spans])

    def _readable(self, span: Made) -> ReadableSpan:
        record, trace_id, span_id, parent_id, link, end_time = span
        operation = OPERATIONS.get(record.route, "chat")
        failed = record.error is not None or record.status >= 400
        return self._span(
            f"{operation} {record.model}" if record.model else operation,
            context=self._context(trace_id, span_id, False, self._sampled),
            parent=self._context(trace_id, parent_id, True, self._sampled)
            if parent_id else None,
            links=() if link is None else (self._link(self._context(
                link[0], link[1], True, self._flags(link[2]))),),
            resource=self._resource, attributes=_attributes(record, operation),
            kind=self._server, status=self._error if failed else self._unset,
            start_time=int(record.time * 1e9), end_time=end_time,
            instrumentation_scope=self._scope)

    def _encoded(self, spans: list[Made]) -> bytes:
        """What `otlp_request` makes of `self._readable` of each, without making them."""
        encoded = []
        for record, trace_id, span_id, parent_id, link, end_time in spans:
            operation = OPERATIONS.get(record.route, "chat")
            failed = record.error is not None or record.status >= 400
            encoded.append(_field(2, b"".join((
                b"\x0a\x10", trace_id.to_bytes(16, "big"),
                b"\x12\x08", span_id.to_bytes(8, "big"),
                b"\x22\x08" + parent_id.to_bytes(8, "big") if parent_id else b"",
                _text(5, f"{operation} {record.model}" if record.model else operation),
                b"\x30\x02",  # SERVER
                b"\x39", _pack_fixed64(int(record.time * 1e9)),
                b"\x41", _pack_fixed64(end_time),
                _attribute_list(9, _attributes(record, operation)),
                b"" if link is None else _link(link[0], link[1], _HAS_IS_REMOTE | _IS_REMOTE),
                b"\x7a\x02\x18\x02" if failed else b"\x7a\x00",  # status ERROR / UNSET
                b"\x85\x01", (_HAS_IS_REMOTE | _IS_REMOTE if parent_id
                                 else _HAS_IS_REMOTE).to_bytes(4, "little")))))
        scope_spans = self._scope_head + b"".join(encoded) + self._scope_tail
        return _field(1, self._resource_head + _field(2, scope_spans) + self._resource_tail)


def span_export_to(endpoint: str, *,
                   client_parent: Callable[[], bool] = lambda: False) -> SpanExport:
    """Spans to an OTLP/HTTP collector at `endpoint` (ImportError without the extra)."""
    return SpanExport(_otlp_http_spans(endpoint), client_parent=client_parent)


def otlp_request(spans: Sequence[ReadableSpan]) -> bytes:
    """An OTLP `ExportTraceServiceRequest` of `spans`, the message the SDK's `encode_spans`
    makes of them, for spans as `SpanExport` makes them: no events, links without a
    trace state, attributes of str, bool, int or float."""
    groups: dict[tuple[int, int], tuple[Any, Any, list[bytes]]] = {}
    for span in spans:
        # By identity: a Resource hashes its attributes as JSON, 20 µs a span.
        key = (id(span.resource), id(span.instrumentation_scope))
        if key not in groups:
            groups[key] = (span.resource, span.instrumentation_scope, [])
        groups[key][2].append(_span(span))
    out = []
    for resource, scope, encoded in groups.values():
        scope_bytes = (_text(1, scope.name) + _text(2, scope.version or "")
                       + _attribute_list(3, scope.attributes) if scope is not None else b"")
        scope_spans = (_field(1, scope_bytes) + b"".join(_field(2, s) for s in encoded)
                       + _text(3, scope.schema_url or "" if scope is not None else ""))
        out.append(_field(1, _field(1, _attribute_list(1, resource.attributes))
                          + _field(2, scope_spans) + _text(3, resource.schema_url)))
    return b"".join(out)


# --- helpers ------------------------------------------------------------------------------

def _otlp_http_spans(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    class OtlpHttpSpans(OTLPSpanExporter):
        """The SDK's OTLP/HTTP exporter, encoding with `otlp_request`: the SDK's encoder
        builds a protobuf object per attribute (~75 µs a span, 2 % of a 200-token answer's
        relay on its own).  Sent through the exporter's own client (a private attribute
        of the pinned SDK version: its retries, headers, TLS and compression)."""

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return self.send_encoded(otlp_request(spans))

        def send_encoded(self, request: bytes) -> SpanExportResult:
            """Sends an encoded `ExportTraceServiceRequest` (`SpanExport` encodes its
            records straight into one, without making the SDK's spans)."""
            if self._shutdown:
                return SpanExportResult.FAILURE
            sent = self._client.export(request)
            return SpanExportResult.SUCCESS if sent.success else SpanExportResult.FAILURE

    return OtlpHttpSpans(endpoint=endpoint)


def _client_span(traceparent: str) -> ClientSpan | None:
    """The trace id, span id and trace flags of a valid `traceparent`."""
    match = TRACEPARENT.match(traceparent) if len(traceparent) <= 512 else None
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if (version == "ff" or (version == "00" and rest) or trace_id == "0" * 32
            or span_id == "0" * 16):
        return None
    return int(trace_id, 16), int(span_id, 16), int(flags, 16)


def _setting(name: str, default: int) -> int:
    """A batch setting of the SDK's (`OTEL_BSP_*`), a positive whole number."""
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


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


# Protobuf's wire format (https://protobuf.dev/programming-guides/encoding/), field
# numbers from opentelemetry-proto's trace.proto and common.proto.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
#: Attributes as KeyValue fields, by field number, name and value (a str or an int: names
#: and most values come back span after span); emptied when it holds `_KEPT_AT_MOST`.
_KEPT: dict[tuple[int, str, Any], bytes] = {}
_KEPT_AT_MOST = 4096
#: A float's KeyValue field less its 8 bytes (its head), by field number and name.
_HEADS: dict[tuple[int, str], bytes] = {}
_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
#: Varints below 128, one byte each.
_SMALL = [bytes((value,)) for value in range(0x80)]


def _span(span: ReadableSpan) -> bytes:
    context = span.context
    parent = span.parent
    assert context is not None
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    status = span.status
    return b"".join((
        b"\x0a\x10", context.trace_id.to_bytes(16, "big"),
        b"\x12\x08", context.span_id.to_bytes(8, "big"),
        _text(3, ",".join(f"{k}={v}" for k, v in context.trace_state.items()))
        if context.trace_state else b"",
        b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent is not None else b"",
        _text(5, span.name),
        b"\x30", _SMALL[span.kind.value + 1],  # the SDK's kinds are the protocol's, less 1
        b"\x39", _pack_fixed64(span.start_time or 0),
        b"\x41", _pack_fixed64(span.end_time or 0),
        _attribute_list(9, span.attributes),
        *(_link(link.context.trace_id, link.context.span_id,
                _HAS_IS_REMOTE | (_IS_REMOTE if link.context.is_remote else 0),
                link.attributes) for link in span.links),
        _field(15, _text(2, status.description or "")
               + (b"\x18" + _SMALL[status.status_code.value] if status.status_code.value
                  else b"")),
        b"\x85\x01", flags.to_bytes(4, "little"),  # field 16, fixed32
    ))


def _link(trace_id: int, span_id: int, flags: int, attributes: Any = None) -> bytes:
    """A Span.Link field: the span linked to and its flags (as the SDK's encoder writes
    them: whether it is remote, not its trace flags)."""
    return _field(13, b"".join((b"\x0a\x10", trace_id.to_bytes(16, "big"),
                                b"\x12\x08", span_id.to_bytes(8, "big"),
                                _attribute_list(4, attributes),
                                b"\x35", flags.to_bytes(4, "little"))))  # field 6, fixed32


def _attribute_list(number: int, attributes: Any) -> bytes:
    """Each attribute as a KeyValue in field `number`."""
    if not attributes:
        return b""
    out = []
    for name, value in attributes.items():
        kind = value.__class__
        if kind is float:
            head = _HEADS.get((number, name))
            if head is None:
                head = _HEADS[(number, name)] = _key_value(number, name, 0.0)[:-8]
            out.append(head + _pack_double(value))
        elif kind is bool:  # never looked up: True == 1
            out.append(_key_value(number, name, value))
        else:
            pair = _KEPT.get((number, name, value))
            if pair is None:
                if len(_KEPT) >= _KEPT_AT_MOST:
                    _KEPT.clear()
                pair = _KEPT[(number, name, value)] = _key_value(number, name, value)
            out.append(pair)
    return b"".join(out)


def _key_value(number: int, name: str, value: Any) -> bytes:
    """A KeyValue field: its key, and its value as an AnyValue."""
    kind = value.__class__
    if kind is str:
        encoded = _field(1, value.encode())
    elif kind is bool:
        encoded = b"\x10\x01" if value else b"\x10\x00"
    elif kind is int:
        encoded = b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64, two's complement
    elif kind is float:
        encoded = b"\x21" + _pack_double(value)
    else:
        raise TypeError(f"attribute {name} is a {kind.__name__}")
    return _field(number, _text(1, name) + _field(2, encoded))


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a message, a string, bytes)."""
    return _tag(number, 2) + _varint(len(payload)) + payload


def _text(number: int, text: str) -> bytes:
    """A string field; nothing for "" (proto3's default is not written)."""
    return _field(number, text.encode()) if text else b""


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
