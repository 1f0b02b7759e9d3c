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
import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.app.sharing.client_config import write_client_config
from backend.app.sharing.snippets import ClientTarget
from tests.clients.conftest import (CLAUDE_OUTPUT, SMOL_ID, ClaudeCode, Run,
                                    add_key, auth_headers,
                                    claude_answered, network_connections, rejections,
                                    until)

# A first run installs the clients (scripts/install-clients); each client run is bounded.
pytestmark = pytest.mark.timeout(900)

MESSAGES = "/v1/messages"


async def test_claude_code_answers_with_the_models_text_streamed(start_smol_studio,
                                                                claude: ClaudeCode):
    service = await start_smol_studio()

    run = await claude.run(service, "Say hello.", output="stream-json",
                           args=("--include-partial-messages",))

    result = claude_answered(run)
    # The answer came in pieces as the engine made them, each one an event of the port's
    # stream that Claude Code passed on.
    deltas = [event["event"]["delta"]["text"] for event in stream_events(run)
              if event["event"]["type"] == "content_block_delta"
              and event["event"]["delta"]["type"] == "text_delta"]
    assert len(deltas) > 1, deltas
    records = await inspected(service)
    # One request: its answer is the deltas.  Greedy SmolLM2 echoes Claude Code's prompt on
    # some dates and paths, and Claude Code then asks it to go on in more requests of the
    # session, whose texts its result joins its own way.
    if not result["is_error"] and len(records) == 1:
        assert "".join(deltas).strip() == result["result"].strip()
    assert [r["status"] for r in records] == [200] * len(records), records  # none resent
    assert len(records) >= result["num_turns"], records
    assert all(r["stream"] and r["session"] == result["session_id"] for r in records), records
    assert records[0]["prompt_tokens"] > 3000, records  # Claude Code's own prompt and tools


async def test_claude_code_connects_to_nothing_but_the_port(start_smol_studio,
                                                           claude: ClaudeCode, strace,
                                                           tmp_path: Path):
    """Offline: no login, telemetry, update check or feature flags reach out."""
    service = await start_smol_studio()
    trace = tmp_path / "claude.strace"

    run = await claude.run(service, "Say hello.", trace=trace)

    claude_answered(run)
    connections = network_connections(trace)
    assert connections, "strace saw no connection at all"
    assert set(connections) == {("127.0.0.1", service.gateway_port)}, connections


async def test_claude_code_turns_resumed_and_continued_are_one_session_with_its_hit_share(
        start_smol_studio, claude: ClaudeCode):
    """Three runs with a named key: a first turn, `--resume ID`, then `--continue`; each
    run sends Claude Code's session id, so the port books one session of three turns,
    each after the first finding the one before in the engine's cache, and the Sessions
    tab's rows show it under the key's name with its hit share."""
    service = await start_smol_studio()
    secret = await add_key("alice")
    env = {"ANTHROPIC_AUTH_TOKEN": secret}

    first = await claude.run(service, "Say hello.", env=env)
    session = claude_answered(first)["session_id"]
    resumed = await claude.run(service, "Say hello.", env=env, args=("--resume", session),
                               continuing=first)
    continued = await claude.run(service, "Say hello.", env=env, args=("--continue",),
                                 continuing=first)

    turns = 0
    for run in (first, resumed, continued):
        result = claude_answered(run)
        assert result["session_id"] == session, result
        turns += result["num_turns"]  # one request each, more for an answer too long
    records = await inspected(service, "alice")
    assert [r["session"] for r in records] == [session] * turns, records
    assert all(r["status"] == 200 for r in records), records
    assert all(r["cached_tokens"] > r["computed_tokens"] for r in records[1:]), records
    (row,) = [row for row in service.session_rows() if row.name == session]
    assert (row.owner, row.model, row.turns) == ("alice", SMOL_ID, turns), row
    cached = sum(r["cached_tokens"] for r in records)
    computed = sum(r["computed_tokens"] for r in records)
    assert row.hit_percent == round(100 * cached / (cached + computed), 1), (row, records)
    assert row.hit_percent > 50, row
    assert row.where.startswith("this machine"), row


async def test_claude_code_waits_out_a_429_for_its_retry_after_and_completes(
        start_smol_studio, claude: ClaudeCode):
    """A key with 9,000 tokens per minute, 7,000 of them held by its own long answer
    running on the one slot: Claude Code's turn (about 4.3k tokens with its output limit)
    does not fit, and is refused with 429 and a `Retry-After` of several seconds (the
    bucket refills 150 tokens a second).  Claude Code waits that long and sends it again:
    refused once, then admitted (to wait in line behind the long answer, which then
    ends), and the turn completes."""
    service = await start_smol_studio()
    secret = await add_key("bob", "--tokens-per-minute", "9000")
    env = {"ANTHROPIC_AUTH_TOKEN": secret}
    body = {"model": SMOL_ID, "max_tokens": 7000, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell a long story."}]}
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {secret}"}) as client:
        async with client.stream("POST", f"http://127.0.0.1:{service.gateway_port}{MESSAGES}",
                                 json=body) as holding:
            assert holding.status_code == 200
            await until(lambda: service.registry.total_active == 1, 30, "the long answer to run")
            process = await claude.start(service, "Say hello.", env=env)
            await until(lambda: rejections(service, "rate_limit_exceeded") == 1, 120,
                        "Claude Code's request to be refused")
            await until(lambda: service.registry.total_waiting == 1 or not process.running,
                        120, "Claude Code's request to come again and wait in line")
    run = await process.result()

    session = claude_answered(run)["session_id"]
    records = [r for r in await inspected(service, "bob") if r["session"] == session]
    refused, served = records[:2]
    assert (refused["status"], served["status"]) == (429, 200), records
    assert refused["error"] == "rate_limit_exceeded", refused
    # Sent again after the wait the port asked for (about 10 s here), not at once.
    assert served["time"] - refused["time"] >= 4.0, (refused, served)


async def test_claude_code_started_as_connect_says_answers_and_its_session_shows(
        start_smol_studio, claude: ClaudeCode, tmp_path: Path, monkeypatch):
    """What `gguf-studio connect` writes for a key (`write_client_config`: the key in its
    0600 file, Claude Code's settings file beside the user's, reading it with
    `apiKeyHelper`), and Claude Code started the way connect prints, with nothing of the
    suite's own set-up (no ANTHROPIC_* variables): it answers, twice in one session, which
    the Sessions rows show under the key's name with its hit share."""
    service = await start_smol_studio()
    secret = await add_key("carol")
    home = tmp_path / "carol"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("CODEX_HOME", str(home / ".codex"))
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(home / ".claude"))
    # No context window: with SmolLM2's 8k window in CLAUDE_CODE_MAX_CONTEXT_TOKENS,
    # Claude Code (its prompt 4k tokens) compacts the conversation before every turn.
    target = ClientTarget(f"http://127.0.0.1:{service.gateway_port}/v1", SMOL_ID, secret,
                          max_output_tokens=CLAUDE_OUTPUT)
    written = write_client_config(target, "office", "Office box")
    argv = shlex.split(written.claude_command)
    assert argv[:2] == ["claude", "--settings"], argv
    env = {"CLAUDE_CONFIG_DIR": str(home / ".claude")}

    first = await claude.run(service, "Say hello.", port_env=False, env=env, args=tuple(argv[1:]))
    session = claude_answered(first)["session_id"]
    again = await claude.run(service, "Say hello.", port_env=False, env=env, continuing=first,
                             args=(*argv[1:], "--continue"))

    assert claude_answered(again)["session_id"] == session
    records = await inspected(service, "carol")
    assert records and all(r["session"] == session and r["status"] == 200 for r in records)
    (row,) = [row for row in service.session_rows() if row.name == session]
    assert (row.owner, row.turns) == ("carol", len(records)), row
    assert row.hit_percent > 0, row


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
