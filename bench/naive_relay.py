"""The slow baseline for `bench/relay.py`: a naive streaming relay on the port's own stack.

What a first Python relay usually looks like: Starlette + uvicorn in front, httpx to the
upstream, and every SSE line of the answer parsed (`json.loads`) and re-serialised
(`json.dumps`) before it is sent on, through a `StreamingResponse`.  No admission, no
auth, no keep-alives: only the per-chunk work, so that the port's CPU per relayed chunk
can be compared with it.

    python bench/naive_relay.py --upstream http://127.0.0.1:8081 [--port 0]

Prints `naive relay on http://127.0.0.1:PORT` once it listens (port 0 picks a free one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


def _dumps(event: object) -> bytes:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()


def build_app(upstream: str) -> Starlette:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=256),
                               trust_env=False)

    async def relay(request: Request) -> Response:
        body = await request.body()
        upstream_request = client.build_request("POST", upstream + request.url.path,
                                                content=body, headers=UPSTREAM_HEADERS)
        try:
            answer = await client.send(upstream_request, stream=True)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # A kept-alive connection the upstream closed just as it was reused (uvicorn
            # closes idle ones after 5 s): nothing was processed, so once more.
            answer = await client.send(upstream_request, stream=True)
        content_type = answer.headers.get("content-type", "")
        if answer.status_code != 200 or "event-stream" not in content_type:
            content = await answer.aread()
            await answer.aclose()
            return Response(content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))

        async def events():
            try:
                async for line in answer.aiter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        if payload == "[DONE]":
                            yield b"data: [DONE]\n\n"
                        else:
                            event = json.loads(payload)
                            yield b"data: " + _dumps(event) + b"\n\n"
                    elif line:
                        yield line.encode() + b"\n"  # event: names, comments
            finally:
                await answer.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", relay, methods=["POST"]),
                             Route("/v1/completions", relay, methods=["POST"])])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    config = uvicorn.Config(build_app(args.upstream.rstrip("/")), lifespan="off", log_config=None,
                            access_log=False, ws="none", proxy_headers=False, server_header=False)
    server = uvicorn.Server(config)
    print(f"naive relay on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    await server.serve(sockets=[sock])


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
