"""Fixtures of the backend tests: a fake upstream and a gateway in front of it."""

from __future__ import annotations

from typing import AsyncIterator

import pytest

from tests.backend.gateway_harness import Gateway, open_gateway
from tests.fake_upstream import FakeUpstream


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(slots=2, n_tokens=8) as upstream:
        yield upstream


@pytest.fixture
async def gw(fake: FakeUpstream) -> AsyncIterator[Gateway]:
    async with open_gateway(fake.base_url, fake.slots) as gateway:
        yield gateway
