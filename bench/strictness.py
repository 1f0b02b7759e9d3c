"""Strictness of the two upstream clients, side by side: the port's own
(`backend/port/upstream_http.py`, its parser `backend/port/http1_response.py`) and aiohttp's
(`bench/variants/upstream_aiohttp.py`).

    python bench/strictness.py

Every malformed answer of `tests/malformed_upstream.py` (a raw asyncio socket: a real
llama-server cannot send them) is sent to each client, then a good answer.  A client
passes a case when the malformed answer raised an `UpstreamError`, nothing was left in its
pool, and the good answer came on a new connection; an answer that is read until the
upstream closes (which it does not) "hangs".  The well-formed twins and interim 1xx
heads must be read, and their connection kept.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from backend.port.upstream_errors import UpstreamError  # noqa: E402
from backend.port.upstream_http import UpstreamClient  # noqa: E402
from bench.variants.upstream_aiohttp import AiohttpUpstreamClient  # noqa: E402
from tests.malformed_upstream import (CLOSE, GOOD_STREAM, INTERIM, MALFORMED, WELL_FORMED,  # noqa: E402
                                      MalformedUpstream)

CLIENTS: dict[str, Callable[[], Any]] = {"ours": UpstreamClient, "aiohttp": AiohttpUpstreamClient}
HANG = 2.0  # seconds without an answer's end: read until a close that never comes


async def exchange(client: Any, base_url: str) -> tuple[int, bytes]:
    response = await client.send(client.build_request(
        "POST", base_url + "/v1/chat/completions", content=b"{}",
        headers={"content-type": "application/json"}))
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


async def refuses(make: Callable[[], Any], answer: bytes) -> str:
    client = make()
    try:
        async with MalformedUpstream([answer]) as upstream:
            try:
                await asyncio.wait_for(exchange(client, upstream.base_url), HANG)
            except UpstreamError:
                pass
            except asyncio.TimeoutError:
                return "HANGS"
            else:
                return "ACCEPTED"
            if client.pooled():
                return "POOLED"
            await asyncio.wait_for(exchange(client, upstream.base_url), HANG)
            return "refused" if upstream.requests == [1, 2] else "REUSED"
    finally:
        await client.aclose()


async def reads(make: Callable[[], Any], answer: bytes) -> str:
    client = make()
    try:
        async with MalformedUpstream([answer]) as upstream:
            try:
                status, _ = await asyncio.wait_for(exchange(client, upstream.base_url), HANG)
            except (UpstreamError, asyncio.TimeoutError) as exc:
                return f"FAILED ({type(exc).__name__})"
            return "read" if status == 200 and client.pooled() == 1 else "NOT KEPT"
    finally:
        await client.aclose()


async def survives_a_closed_keepalive(make: Callable[[], Any], _: bytes) -> str:
    """The upstream closes a kept-alive connection as the next request arrives (uvicorn
    and llama-server close idle ones after 5 s): nothing was processed, so a retry on a
    new connection is safe."""
    client = make()
    try:
        async with MalformedUpstream([GOOD_STREAM, CLOSE]) as upstream:
            await exchange(client, upstream.base_url)
            try:
                await asyncio.wait_for(exchange(client, upstream.base_url), HANG)
            except (UpstreamError, asyncio.TimeoutError) as exc:
                return f"FAILED ({type(exc).__name__})"
            return "read"
    finally:
        await client.aclose()


async def main() -> int:
    rows = ["| case | " + " | ".join(CLIENTS) + " |", "|---|" + "---|" * len(CLIENTS)]
    passed = {name: 0 for name in CLIENTS}
    cases = [(name, answer, refuses) for name, answer in MALFORMED.items()]
    cases += [(f"{name} (well formed)", answer, reads) for name, answer in WELL_FORMED.items()]
    cases += [(f"{name}, then 200", answer + GOOD_STREAM, reads) for name, answer in INTERIM.items()]
    cases.append(("kept-alive connection closed as it is reused", b"", survives_a_closed_keepalive))
    for case, answer, check in cases:
        results = []
        for name, make in CLIENTS.items():
            result = await check(make, answer)
            passed[name] += result in ("refused", "read")
            results.append(result)
        rows.append(f"| {case} | " + " | ".join(results) + " |")
    print(f"Strictness: {len(cases)} cases (malformed: refused, pool empty, next request on a "
          "new connection; well formed and 1xx: read, connection kept; a kept-alive connection "
          "closed as it is reused: the request is served)\n")
    print("\n".join(rows))
    print("\npassed: " + ", ".join(f"{name} {n}/{len(cases)}" for name, n in passed.items()))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
