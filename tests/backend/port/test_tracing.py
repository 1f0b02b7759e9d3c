"""OpenTelemetry export of the inspector's records: a span per request with the GenAI
attributes, always exported (a client flagging its context "not sampled" hides nothing),
linked to the client's span or (when the owner opts in) in the client's trace, an error
status on a failed one, sent to a real OTLP/HTTP receiver in the message the SDK's own
encoder makes; nothing of OpenTelemetry imported when it is off."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as WireSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from backend.app.service import StudioService
from backend.llama.load import LoadSettings
from backend.port.request_log import RequestRecord
from backend.port.tracing import SpanExport, otlp_request
from tests.backend.service_harness import ServiceFactory

ROOT = Path(__file__).resolve().parents[3]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def chat(tokens: int) -> dict:
    return {"model": "tiny", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}


async def stream(port: int | None, body: dict, headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=headers) as response:
            assert response.status_code == 200
            await response.aread()


async def test_a_request_is_a_span_with_the_genai_attributes_in_the_clients_trace(
        running_service: ServiceFactory, tiny_model: Path):
    service = await running_service(otel_client_parent=True)
    await service.load(LoadSettings(parallel="1", ctx_size=4096).to_spec(str(tiny_model)))
    memory = InMemorySpanExporter()
    service.requests.exporter = SpanExport(
        memory, batch=False, client_parent=lambda: service.settings.otel_client_parent)
    await stream(service.gateway_port, chat(7),
                 {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-session-id": "agent-7"})
    await stream(service.gateway_port, chat(3), {})
    first, second = memory.get_finished_spans()
    assert first.name == "chat tiny" and first.kind is SpanKind.SERVER
    assert f"{first.context.trace_id:032x}" == TRACE_ID
    assert first.parent is not None and f"{first.parent.span_id:016x}" == PARENT_ID
    attributes = dict(first.attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.usage.output_tokens"] == 7
    assert isinstance(attributes["gen_ai.usage.input_tokens"], int)
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["gguf_studio.session"] == "agent-7"
    assert attributes["http.response.status_code"] == 200
    assert first.end_time is not None and first.start_time is not None
    assert first.end_time > first.start_time
    assert first.status.status_code is StatusCode.UNSET
    assert first.links == ()
    # No traceparent: a trace of its own.
    assert second.parent is None and second.context.trace_id != first.context.trace_id


async def test_a_clients_context_is_a_link_and_not_sampled_hides_nothing(
        running_service: ServiceFactory, tiny_model: Path):
    """By default a client on the LAN neither picks the trace of the owner's span (its
    context is a link) nor keeps its request out of the export by flagging its context
    "not sampled"; opted in, the request joins the client's trace, sampled or not."""
    service = await running_service()
    await service.load(LoadSettings(parallel="1", ctx_size=4096).to_spec(str(tiny_model)))
    memory = InMemorySpanExporter()
    service.requests.exporter = SpanExport(
        memory, batch=False, client_parent=lambda: service.settings.otel_client_parent)
    await stream(service.gateway_port, chat(2),
                 {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00", "x-session-id": "hidden"})
    await stream(service.gateway_port, chat(2),
                 {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    service.settings.otel_client_parent = True  # the owner opts in, live
    await stream(service.gateway_port, chat(2),
                 {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    unsampled, sampled, joined = memory.get_finished_spans()
    assert dict(unsampled.attributes or {})["gguf_studio.session"] == "hidden"
    for span, flags in ((unsampled, 0), (sampled, 1)):
        assert span.parent is None and f"{span.context.trace_id:032x}" != TRACE_ID
        assert span.context.trace_flags.sampled
        [link] = span.links
        assert f"{link.context.trace_id:032x}" == TRACE_ID
        assert f"{link.context.span_id:016x}" == PARENT_ID
        assert link.context.is_remote and link.context.trace_flags == flags
    assert unsampled.context.trace_id != sampled.context.trace_id
    assert f"{joined.context.trace_id:032x}" == TRACE_ID and joined.links == ()
    assert joined.parent is not None and f"{joined.parent.span_id:016x}" == PARENT_ID


async def test_a_failed_request_is_a_span_with_an_error_status(
        running_service: ServiceFactory, tiny_model: Path):
    service = await running_service()
    await service.load(LoadSettings(parallel="1", ctx_size=4096).to_spec(str(tiny_model)))
    memory = InMemorySpanExporter()
    service.requests.exporter = SpanExport(memory, batch=False)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=60) as client:
        response = await client.post("/v1/chat/completions",
                                     json={**chat(5), "max_tokens": 0},
                                     headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert response.status_code == 400
    [span] = memory.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    attributes = dict(span.attributes or {})
    assert attributes["error.type"] == "invalid_request"
    assert attributes["http.response.status_code"] == 400
    assert span.parent is None and f"{span.links[0].context.span_id:016x}" == PARENT_ID


def test_a_client_context_that_is_not_sampled_still_has_a_child_when_the_owner_opts_in():
    memory = InMemorySpanExporter()
    export = SpanExport(memory, batch=False, client_parent=lambda: True)
    for traceparent in (f"00-{TRACE_ID}-{PARENT_ID}-00",  # not sampled: its child all the same
                        f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # malformed: a trace of its own
                        f"00-{'0' * 32}-{PARENT_ID}-01"):  # invalid: a trace of its own
        export(record(), traceparent)
    child, *alone = memory.get_finished_spans()
    assert f"{child.context.trace_id:032x}" == TRACE_ID and child.context.trace_flags.sampled
    assert child.parent is not None and f"{child.parent.span_id:016x}" == PARENT_ID
    assert len(alone) == 2
    assert all(span.parent is None and span.links == () for span in alone)
    assert all(f"{span.context.trace_id:032x}" != TRACE_ID for span in alone)


def test_spans_are_encoded_as_the_sdks_own_otlp_encoder_encodes_them():
    memory = InMemorySpanExporter()
    parent = False
    export = SpanExport(memory, batch=False, client_parent=lambda: parent)
    export(record(), f"00-{TRACE_ID}-{PARENT_ID}-01")  # a link
    parent = True
    export(record(), f"00-{TRACE_ID}-{PARENT_ID}-00")  # a parent
    parent = False
    export(record(status=429, error="rate_limit_exceeded", model=None, session=None,
                  route="/v1/embeddings", wait=0.0, prompt_tokens=2**40), None)
    export(record(key="ünïcode ✓", prompt_tokens=0, tokens_per_second=0.0), None)
    spans = memory.get_finished_spans()
    assert len(spans) == 4 and len(spans[0].links) == 1 and spans[1].parent is not None
    ours = ExportTraceServiceRequest.FromString(otlp_request(spans))
    assert ours == encode_spans(spans)
    assert ExportTraceServiceRequest.FromString(otlp_request(spans[:1])) == encode_spans(
        spans[:1])


def test_records_are_encoded_straight_as_the_sdks_encoder_encodes_their_spans():
    # To the OTLP exporter the export thread sends records encoded without making the
    # SDK's spans (`_encoded`); to any other exporter it hands those spans (`_readable`).
    export = SpanExport(InMemorySpanExporter(), batch=False)
    made = [(record(), int(TRACE_ID, 16), 0x1234, int(PARENT_ID, 16), None,
             1_700_000_001 * 10**9),
            (record(status=429, error="rate_limit_exceeded", model=None, session=None,
                    route="/v1/embeddings", wait=0.0, prompt_tokens=2**40),
             2**127 + 5, 2**63 + 7, 0, None, 1_700_000_002 * 10**9),
            (record(key="ünïcode ✓", prompt_tokens=0, tokens_per_second=0.0, status=502),
             1, 2, 0, (int(TRACE_ID, 16), int(PARENT_ID, 16), 0), 1_700_000_003 * 10**9),
            (record(), 3, 4, 0, (2**128 - 1, 2**64 - 1, 1), 1_700_000_004 * 10**9)]
    spans = [export._readable(span) for span in made]
    assert ExportTraceServiceRequest.FromString(export._encoded(made)) == encode_spans(spans)
    assert ExportTraceServiceRequest.FromString(export._encoded(made[1:2])) == encode_spans(
        spans[1:2])


def test_closing_exports_the_spans_still_waiting_for_their_batch(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # no batch would go before close
    memory = InMemorySpanExporter()
    export = SpanExport(memory)
    export(record(), f"00-{TRACE_ID}-{PARENT_ID}-01")
    export(record(status=500, error="upstream_failed"), None)
    assert memory.get_finished_spans() == ()
    export.close()
    first, second = memory.get_finished_spans()
    assert f"{first.links[0].context.trace_id:032x}" == TRACE_ID
    assert second.status.status_code is StatusCode.ERROR
    export(record(), None)  # a port closing: no span, no error
    assert len(memory.get_finished_spans()) == 2


def record(**fields: object) -> RequestRecord:
    """A finished request as the relay records it."""
    base: dict = dict(id=1, time=1_700_000_000.25, route="/v1/chat/completions", key="owner",
                      session="agent-7", model="tiny", engine="this machine", slot=2,
                      band="normal", stream=True, wait=0.125, wait_reason="slots_full",
                      prompt_tokens=30, cached_tokens=10, computed_tokens=20,
                      output_tokens=200, prefill_ms=3.5, time_to_first_token=0.05,
                      tokens_per_second=120.5, longest_gap=0.02)
    return RequestRecord(**{**base, **fields})


class OtlpReceiver:
    """A minimal OTLP/HTTP collector: answers 200 to each POST and keeps its spans."""

    def __init__(self) -> None:
        self.spans: list = []
        self.arrived = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/traces"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            message = ExportTraceServiceRequest()
            message.ParseFromString(await reader.readexactly(length))
            for resource in message.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                         b"Content-Length: 0\r\n\r\n")
            await writer.drain()
            self.arrived.set()


async def test_spans_reach_an_otlp_collector_at_the_configured_endpoint(
        running_service: ServiceFactory, tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # milliseconds between batches
    receiver = OtlpReceiver()
    endpoint = await receiver.start()
    try:
        service = await running_service(otel_endpoint=endpoint)
        await service.load(LoadSettings(parallel="1", ctx_size=4096).to_spec(str(tiny_model)))
        await stream(service.gateway_port, chat(5),
                     {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        await asyncio.wait_for(receiver.arrived.wait(), 30)
    finally:
        assert receiver.server is not None
        receiver.server.close()
    [span] = receiver.spans
    attributes = {a.key: a.value for a in span.attributes}
    assert span.name == "chat tiny" and span.kind == WireSpan.SPAN_KIND_SERVER
    # A trace of the port's own, linked to the client's span.
    assert span.trace_id.hex() != TRACE_ID and span.parent_span_id == b""
    [link] = span.links
    assert link.trace_id.hex() == TRACE_ID and link.span_id.hex() == PARENT_ID
    assert attributes["gen_ai.operation.name"].string_value == "chat"
    assert attributes["gen_ai.provider.name"].string_value == "llama.cpp"
    assert attributes["gen_ai.request.model"].string_value == "tiny"
    assert attributes["gen_ai.usage.input_tokens"].int_value > 0
    assert attributes["gen_ai.usage.output_tokens"].int_value == 5
    assert attributes["gguf_studio.time_to_first_token_seconds"].double_value > 0
    assert span.end_time_unix_nano > span.start_time_unix_nano


def test_without_an_endpoint_nothing_of_opentelemetry_is_imported(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_STATE_HOME=str(tmp_path / "state"),
               XDG_CACHE_HOME=str(tmp_path / "cache"), HOME=str(tmp_path))
    script = ("import sys\n"
              "from backend.app.service import StudioService\n"
              "from backend.port.gateway import create_app\n"
              "from backend.settings import Settings\n"
              "service = StudioService(Settings())\n"
              "create_app(service)\n"
              "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_an_exporter_that_fails_never_fails_the_request_record():
    from backend.port.request_log import RequestLog

    ring = RequestLog()

    def broken(record: object, traceparent: str | None) -> None:
        raise RuntimeError("collector gone")

    ring.exporter = broken
    record = ring.add(route="/v1/chat/completions", key="owner")
    assert ring.records() == [record]
