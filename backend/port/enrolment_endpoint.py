"""The port's enrolment endpoint: a teammate without a key asks for one.

    POST /v1/enrolments        {"name": "alice"}  -> 202 {"id", "code", "expires_in", ...}
    GET  /v1/enrolments/{id}?wait=S               -> {"status": "pending", ...} after at
                                                     most S seconds (30 at most), or the
                                                     approved key once, or 403 refused,
                                                     404 expired or unknown

Both are open without a key (the requester has none yet): the owner's approval is what
grants anything, the id is 192 random bits only the requester learns, and the state
behind them is bounded and rate-limited (`backend.enrolments`).  Open only on a port
that requires keys and whose owner left enrolment on; else 404 `enrolment_closed`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend.enrolments import APPROVED, PENDING, Enrolments
from backend.errors import BodyTooLarge, EnrolmentClosed, InvalidRequest
from backend.key_store import KeyRecord

__all__ = ["ENROL_PATH", "MAX_BODY", "MAX_WAIT", "EnrolmentEndpoint"]

ENROL_PATH = "/v1/enrolments"
#: Seconds one poll may be held open before it is answered "pending".
MAX_WAIT = 30.0
#: Bytes of a request body: a name fits in far less.
MAX_BODY = 4096


class EnrolmentEndpoint:
    """`enrolments()`: the port's requests, None while enrolment is closed;
    `describe(record)`: what a client of that key needs to know of the port's models."""

    def __init__(self, enrolments: Callable[[], Enrolments | None],
                 describe: Callable[[KeyRecord], dict[str, Any]]) -> None:
        self._enrolments = enrolments
        self._describe = describe

    async def create(self, request: Request) -> Response:
        enrolments = self._open()
        body = await _small_body(request)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise InvalidRequest("Send JSON: {\"name\": \"alice\"}.") from None
        if not isinstance(data, dict):
            raise InvalidRequest("Send JSON: {\"name\": \"alice\"}.")
        client = request.client.host if request.client is not None else "unknown"
        enrolment = enrolments.request(data.get("name"), client)  # type: ignore[arg-type]
        return JSONResponse({"id": enrolment.token, "name": enrolment.name,
                             "code": enrolment.code, "status": PENDING,
                             "expires_in": math.ceil(enrolments.seconds_left(enrolment)),
                             "poll": f"{ENROL_PATH}/{enrolment.token}"}, status_code=202)

    async def poll(self, request: Request) -> Response:
        enrolments = self._open()
        try:
            wait = min(MAX_WAIT, max(0.0, float(request.query_params.get("wait", "0"))))
        except ValueError:
            raise InvalidRequest("wait is a number of seconds.", param="wait") from None
        if not math.isfinite(wait):
            wait = 0.0
        enrolment = await enrolments.wait(str(request.path_params["token"]), wait)
        if enrolment.state == PENDING:
            return JSONResponse({"status": PENDING, "name": enrolment.name,
                                 "code": enrolment.code,
                                 "expires_in": math.ceil(enrolments.seconds_left(enrolment))})
        record = enrolment.record
        secret = enrolments.collect(enrolment)  # raises the refusal, once
        assert enrolment.state == APPROVED and record is not None
        return JSONResponse({"status": APPROVED, "name": record.name, "api_key": secret,
                             "port": self._describe(record)},
                            headers={"Cache-Control": "no-store"})

    def _open(self) -> Enrolments:
        enrolments = self._enrolments()
        if enrolments is None:
            raise EnrolmentClosed("This server takes no enrolment requests; ask its owner "
                                  "for a key.")
        return enrolments


async def _small_body(request: Request) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise BodyTooLarge(f"An enrolment request has at most {MAX_BODY} bytes.")
    return body
