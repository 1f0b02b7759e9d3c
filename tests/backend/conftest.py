"""Fixtures of the backend tests: a fake upstream and a gateway in front of it; a real
service (`running_service`, each test file's `service` with its own settings) and a
client of its port (`port_client`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from backend.app.service import StudioService
from backend.settings import Settings
from tests.backend.gateway_harness import Gateway, open_gateway
from tests.backend.service_harness import ServiceFactory
from tests.fake_upstream import FakeUpstream



@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(slots=2, n_tokens=8) as upstream:
        yield upstream


@pytest.fixture
async def gw(fake: FakeUpstream) -> AsyncIterator[Gateway]:
    async with open_gateway(fake.base_url, fake.slots) as gateway:
        yield gateway


@pytest.fixture
async def running_service(tmp_path: Path, llama_server_binary: Path
                          ) -> AsyncIterator[ServiceFactory]:
    """`await running_service(**settings)`: a StudioService on the suite's engine, its port
    open on a free port of this machine, `settings` over port 0 and a 60 s load timeout,
    its logs under the test's tmp_path; closed when the test ends."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(**settings: Any) -> StudioService:
            # No grace for resends unless asked (backend.port.resends): a client that
            # leaves is cut at once, as the tests of leaving clients assert.
            chosen: dict[str, Any] = {"port": 0, "llama_server": str(llama_server_binary),
                                      "load_timeout": 60, "resend_grace": 0, **settings}
            service = StudioService(Settings(**chosen), log_dir=tmp_path / "logs")
            stack.push_async_callback(service.close)
            await service.start_gateway()
            return service
        yield start


@pytest.fixture
async def port_client(service: StudioService) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the test file's `service`'s port (no key; 120 s timeout)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120) as client:
        yield client
