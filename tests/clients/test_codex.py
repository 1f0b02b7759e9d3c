"""Codex CLI (`codex exec`) against the port, over the Responses wire.

Codex prints the final answer on stdout only from `response.output_item.done` and counts
a stream without `response.completed` as dropped, so "exit 0 with text on stdout" proves
the port's Responses stream is complete.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from backend.app.sharing.snippets import KEY_ENV_VAR, ClientModel, ClientTarget, codex_snippet
from tests.clients.conftest import (API_KEY, CONTEXT, KEEPALIVE, MODEL_ID, OUTPUT_CAP, Codex,
                                    add_key, base_url, key_sample, key_target, listed_keys,
                                    network_connections, occupied, occupied_place,
                                    pasted_codex_files, pasted_env, rejections, responses_count,
                                    revoke_key, scraped_metrics, until)

# A first run installs the clients (scripts/install-clients); each client run is bounded.
pytestmark = pytest.mark.timeout(600)

RESPONSES = "/v1/responses"


async def test_codex_exec_answers_with_the_models_text(start_studio, codex: Codex):
    service = await start_studio(parallel=1)

    run = await codex.run(service, "Say hello.")

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, "exit 0 but no text: no response.output_item.done reached Codex\n" + run.describe()
    assert responses_count(service, RESPONSES, 200) == 1


async def test_codex_connects_to_nothing_but_the_port(start_studio, codex: Codex, strace,
                                                     tmp_path):
    """Offline: no login, telemetry, update check or plugin sync reaches out."""
    service = await start_studio(parallel=1)
    trace = tmp_path / "codex.strace"

    run = await codex.run(service, "Say hello.", trace=trace)

    assert run.returncode == 0 and run.text, run.describe()
    connections = network_connections(trace)
    assert connections, "strace saw no connection at all"
    assert set(connections) == {("127.0.0.1", service.gateway_port)}, connections


async def test_codex_waiting_in_line_longer_than_its_idle_timeout_is_kept_alive(
        start_studio, codex: Codex):
    """Codex's stream idle timer ignores SSE comments: the port's response.created /
    response.in_progress events while queued are what keep the request alive.

    A first run puts Codex's ~5k-token prompt in llama-server's prompt cache, so that
    what is measured here is the wait in line (the silence while the engine reads a prompt
    is the next test's)."""
    service = await start_studio(parallel=1)
    warm_up = await codex.run(service, "Say hello.")
    assert warm_up.returncode == 0 and warm_up.text, warm_up.describe()
    idle_timeout = 2.0
    async with occupied(service):
        # No retries: a stream Codex gave up on must fail the run, not be sent again.
        process = await codex.start(service, "Say hello.",
                                    stream_idle_timeout_ms=int(idle_timeout * 1000),
                                    stream_max_retries=0, request_max_retries=0)
        await until(lambda: service.registry.total_waiting == 1, 60, "Codex to wait in line")
        await asyncio.sleep(3 * idle_timeout)
        assert process.running, "Codex gave up while queued\n" + (await process.result()).describe()
        assert service.registry.total_waiting == 1
    # The slot is free: Codex is admitted and answers.
    run = await process.result()

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, "exit 0 but no text: no response.output_item.done reached Codex\n" + run.describe()
    assert responses_count(service, RESPONSES, 200) == 2  # warm-up + this one, never re-sent
    assert KEEPALIVE < idle_timeout / 5


async def test_codex_engine_silent_longer_than_the_idle_timeout_is_kept_alive(
        start_studio, codex: Codex):
    """A long prompt keeps the engine silent (prompt processing) for longer than Codex's
    idle timeout, with no queueing at all; a real model on a CPU does this with Codex's
    own growing context (default idle timeout 300 s).  llama-server sends nothing, not even
    response.created, before its first token: the port's events must cover that silence."""
    service = await start_studio(parallel=1)
    long_prompt = "Summarise these words: " + " ".join(f"word{i}" for i in range(3000))

    run = await codex.run(service, long_prompt, stream_idle_timeout_ms=1000,
                          stream_max_retries=0, request_max_retries=0)

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()


async def test_codex_retries_a_429_and_succeeds_once_a_place_frees(start_studio, codex: Codex):
    """max_queue 1: with the slot busy and the one waiting place taken, Codex's request is
    refused with 429 + Retry-After; Codex retries it and succeeds once the line empties."""
    service = await start_studio(parallel=1, max_queue=1)
    async with occupied(service):
        async with occupied_place(service) as waiting:
            # A few more retries than the default 4, to ride out 429s until the line empties.
            process = await codex.start(service, "Say hello.", request_max_retries=6)
            await until(lambda: rejections(service, "server_is_overloaded") >= 1, 60,
                        "Codex's request to be refused")
            assert process.running
    await waiting

    run = await process.result()

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()
    assert responses_count(service, RESPONSES, 429) >= 1
    assert responses_count(service, RESPONSES, 200) == 1


async def test_codex_switches_to_another_model_of_the_port_with_the_snippets_profile(
        start_studio, codex: Codex):
    """The Codex snippet of a port with two models, pasted as it is (plus the suite's
    offline switches): --strict-config takes config.toml and the profile file, and
    `codex --profile NAME` asks for that model.  (Which context window Codex then plans
    with shows nowhere outside it: a run with the profile's window left out looks alike.)"""
    service = await start_studio(parallel=1)
    target = ClientTarget(base_url(service), "never-asked-for", API_KEY, context_length=4096,
                          max_output_tokens=OUTPUT_CAP, others=(ClientModel(MODEL_ID, CONTEXT),))
    snippet = codex_snippet(target)
    (profile,) = snippet.files

    run = await codex.run(service, "Say hello.", files=pasted_codex_files(snippet),
                          args=tuple(profile.usage.split()[1:]),
                          env={KEY_ENV_VAR: API_KEY})

    assert run.returncode == 0 and run.text, run.describe()
    assert f"model: {MODEL_ID}\n" in run.stderr, run.describe()  # Codex's header: the profile's
    assert responses_count(service, RESPONSES, 200) == 1, run.describe()  # never re-sent


# --- named keys ------------------------------------------------------------------------------

async def run_with_key(codex: Codex, service, secret: str, prompt: str = "Say hello.", **kwargs):
    """Codex as the user sets it up for a named key: the Codex snippet made for that key's
    secret, its config.toml pasted and its `export` line run."""
    snippet = codex_snippet(key_target(service, secret))
    assert secret not in snippet.text  # the file names the variable; the shell line sets it
    return await codex.start(service, prompt, files=pasted_codex_files(snippet),
                             env=pasted_env(snippet), **kwargs)


async def test_codex_with_a_named_keys_snippet_answers_and_its_usage_shows_by_name(
        start_studio, codex: Codex):
    service = await start_studio(parallel=1)
    secret = await add_key("alice", "--tokens-per-minute", "200000")

    run = await (await run_with_key(codex, service, secret)).result()

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()
    used = service.usage.usage("alice")
    assert used.requests == 1 and used.refusals == {}, used
    assert "owner" not in service.usage.snapshot()  # nothing counted against the owner's key
    metrics = await scraped_metrics(service)
    assert key_sample(metrics, "gguf_studio_key_requests_total", "alice") == 1
    assert key_sample(metrics, "gguf_studio_key_tokens_total", "alice",
                      kind="completion") == used.completion_tokens
    listed = (await listed_keys(service))["alice"]
    assert listed["usage"]["requests"] == 1 and listed["usage"]["refusals"] == {}, listed
    assert listed["usage"]["prompt_tokens"] == used.prompt_tokens, listed
    assert listed["tokens_per_minute"] == 200000
    assert used.completion_tokens == OUTPUT_CAP, used
    assert used.prompt_tokens > 1000, used  # Codex's own long instructions


async def test_codex_with_a_key_not_allowed_the_model_fails_clearly_and_other_keys_still_work(
        start_studio, codex: Codex):
    service = await start_studio(parallel=1)
    narrow = await add_key("narrow", "--models", "other-*")
    alice = await add_key("alice")

    refused = await (await run_with_key(codex, service, narrow)).result()
    served = await (await run_with_key(codex, service, alice)).result()

    assert refused.returncode != 0 and not refused.timed_out, refused.describe()
    assert "may not use the model 'tiny'" in refused.stdout + refused.stderr, refused.describe()
    assert served.returncode == 0 and served.text, served.describe()
    narrow_used, alice_used = service.usage.usage("narrow"), service.usage.usage("alice")
    assert narrow_used.requests == 0 and set(narrow_used.refusals) == {"model_not_allowed"}
    refusals = narrow_used.refusals["model_not_allowed"]
    # Codex "reconnects" after any failed stream, a 403 too (5 times by default), then stops.
    assert 1 <= refusals <= 6, narrow_used
    assert alice_used.requests == 1 and alice_used.refusals == {}
    metrics = await scraped_metrics(service)
    assert key_sample(metrics, "gguf_studio_key_refusals_total", "narrow",
                      reason="model_not_allowed") == refusals
    assert responses_count(service, RESPONSES, 403) == refusals


async def test_codex_waiting_in_line_when_its_key_is_revoked_fails_clearly_and_others_are_served(
        start_studio, codex: Codex):
    """Codex waits behind a long generation (its stream already begun, kept alive), a
    colleague's request with another key waits too; `gguf-studio keys revoke` in another
    process ends Codex's request with the revocation in the stream, and Codex's retries get
    401 at once, while the colleague's request keeps its place and is served."""
    service = await start_studio(parallel=1)
    alice = await add_key("alice")
    bob = await add_key("bob")
    async with httpx.AsyncClient(timeout=120) as client:
        async with occupied(service):
            process = await run_with_key(codex, service, alice)
            await until(lambda: service.registry.total_waiting == 1, 60, "Codex to wait in line")
            colleague = asyncio.ensure_future(client.post(
                f"{base_url(service)}/chat/completions",
                headers={"Authorization": f"Bearer {bob}"},
                json={"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]}))
            await until(lambda: service.registry.total_waiting == 2, 30, "bob to wait in line")
            await revoke_key(service, "alice")
            run = await process.result()
            assert not colleague.done()  # still waiting behind the long generation
        answer = await colleague

    assert run.returncode != 0 and not run.timed_out, run.describe()
    assert "'alice' was revoked" in run.stdout + run.stderr, run.describe()
    assert answer.status_code == 200, answer.text
    assert service.usage.usage("bob").requests == 1 and service.usage.usage("bob").refusals == {}
    # The request refused in line counts against alice; Codex's reconnects after it were
    # refused at the door, before the port knew a usable key (401, counted by route).
    alice_used = service.usage.usage("alice")
    assert alice_used.requests == 0 and alice_used.refusals == {"invalid_api_key": 1}, alice_used
    assert 1 <= responses_count(service, RESPONSES, 401) <= 6
