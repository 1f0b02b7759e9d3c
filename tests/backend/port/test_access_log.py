"""The access log shows what a client sent, and a client cannot write lines into it."""

from __future__ import annotations

import logging

from backend.port.access_log import ACCESS_LOGGER, loggable_path
from tests.backend.gateway_harness import until


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]


async def test_an_encoded_newline_in_the_path_cannot_forge_a_log_line(gw, caplog):
    forged = "/v1/models%0aPOST%20/v1/chat/completions%20200%201.0ms"
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        response = await gw.client.get(forged)
        await until(lambda: len(_lines(caplog)) == 1)
    assert response.status_code == 404
    [line] = _lines(caplog)
    assert "\n" not in line and "\r" not in line
    assert line.startswith(f"GET {forged} 404 ")


async def test_control_and_non_ascii_bytes_are_escaped(gw, caplog):
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        await gw.client.get("/caf%C3%A9%0d%1b[31m")
        await until(lambda: len(_lines(caplog)) == 1)
    assert _lines(caplog)[0].startswith("GET /caf%C3%A9%0d%1b[31m 404 ")


def test_a_server_without_raw_paths_still_logs_an_encoded_path():
    assert loggable_path({"path": "/a b\nc\u00e9"}) == "/a%20b%0Ac%C3%A9"
    assert loggable_path({"path": "/x", "raw_path": b"/x\x00\xff y"}) == "/x%00%FF%20y"
