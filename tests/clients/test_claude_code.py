"""Claude Code (`claude -p`) against the port, over `/v1/messages`, on SmolLM2.

Claude Code runs as a user sets it up for the port: `ANTHROPIC_BASE_URL` at the port, the
key as its auth token (or an `apiKeyHelper` reading it), and every model alias it asks
for (the main model, the small fast one, haiku/sonnet/opus, subagents) pointed at the
port's model; non-essential traffic off.  Its prompt (system prompt and tool
definitions) is about 4k tokens, so every first turn spends about 25 s in SmolLM2's
prefill on one engine thread: each run is bounded by `CLAUDE_TIMEOUT`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.clients.conftest import (API_KEY, KEY_ENV, SMOL_ID, ClaudeCode, Run, add_key,
                                    auth_headers, claude_result, network_connections,
                                    rejections, responses_count)

# A first run installs the clients (scripts/install-clients); each client run is bounded.
pytestmark = pytest.mark.timeout(900)

MESSAGES = "/v1/messages"


async def test_claude_code_answers_with_the_models_text_streamed(start_smol_studio,
                                                                claude: ClaudeCode):
    service = await start_smol_studio()

    run = await claude.run(service, "Say hello.", output="stream-json",
                           args=("--include-partial-messages",))

    assert run.returncode == 0 and not run.timed_out, run.describe()
    result = claude_result(run)
    assert result["subtype"] == "success" and not result["is_error"], result
    assert result["result"].strip(), result
    # The answer came in pieces as the engine made them, each one an event of the port's
    # stream that Claude Code passed on.
    deltas = [event["event"]["delta"]["text"] for event in stream_events(run)
              if event["event"]["type"] == "content_block_delta"
              and event["event"]["delta"]["type"] == "text_delta"]
    assert len(deltas) > 1, deltas
    assert "".join(deltas).strip() == result["result"].strip()
    assert responses_count(service, MESSAGES, 200) == 1, run.describe()  # nothing resent
    (record,) = await inspected(service)
    assert record["stream"] is True and record["session"] == result["session_id"], record
    assert record["prompt_tokens"] > 3000, record  # Claude Code's own prompt and tools


async def test_claude_code_connects_to_nothing_but_the_port(start_smol_studio,
                                                           claude: ClaudeCode, strace,
                                                           tmp_path: Path):
    """Offline: no login, telemetry, update check or feature flags reach out."""
    service = await start_smol_studio()
    trace = tmp_path / "claude.strace"

    run = await claude.run(service, "Say hello.", trace=trace)

    assert run.returncode == 0 and claude_result(run)["result"].strip(), run.describe()
    connections = network_connections(trace)
    assert connections, "strace saw no connection at all"
    assert set(connections) == {("127.0.0.1", service.gateway_port)}, connections


# --- helpers -----------------------------------------------------------------------------

def stream_events(run: Run) -> list[dict[str, Any]]:
    """The `stream_event` messages of a `--output-format stream-json
    --include-partial-messages` run: the wire's events as Claude Code read them."""
    return [message for line in run.stdout.splitlines() if line.startswith("{")
            for message in [json.loads(line)] if message.get("type") == "stream_event"]


async def inspected(service, key: str | None = None) -> list[dict[str, Any]]:
    """The inspector's records of `/v1/messages` (of `key`, unless None), oldest first,
    as the owner reads them."""
    async with httpx.AsyncClient(timeout=30, headers=auth_headers()) as client:
        answer = await client.get(f"http://127.0.0.1:{service.gateway_port}/requests")
    assert answer.status_code == 200, answer.text
    records = [r for r in answer.json()["data"] if r["route"] == MESSAGES
               and (key is None or r["key"] == key)]
    return sorted(records, key=lambda r: r["id"])
