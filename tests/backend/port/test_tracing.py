"""OpenTelemetry export of the inspector's records: a span per request with the GenAI
attributes, in the client's trace, sent to a real OTLP/HTTP receiver; nothing of
OpenTelemetry imported when it is off."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from backend.app.service import StudioService
from backend.llama.load import LoadSettings
from backend.port.tracing import SpanExport
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
    service = await running_service()
    await service.load(LoadSettings(parallel="1", ctx_size=4096).to_spec(str(tiny_model)))
    memory = InMemorySpanExporter()
    service.requests.exporter = SpanExport(memory, batch=False)
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
    # No traceparent: a trace of its own.
    assert second.parent is None and second.context.trace_id != first.context.trace_id


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
        await stream(service.gateway_port, chat(5), {})
        await asyncio.wait_for(receiver.arrived.wait(), 30)
    finally:
        assert receiver.server is not None
        receiver.server.close()
    [span] = receiver.spans
    attributes = {a.key: a.value for a in span.attributes}
    assert span.name == "chat tiny"
    assert attributes["gen_ai.usage.output_tokens"].int_value == 5


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
