"""OpenCode (`opencode run`) against the port, over chat completions.

OpenCode sends two streamed chat requests per run (the session title and the turn), and
re-requests when a stream ends without a finish_reason, so every run here is bounded by a
hard timeout and a test fails, rather than hangs, if it would loop.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from backend.app.sharing.snippets import KEY_ENV_VAR, ClientModel, ClientTarget, opencode_snippet
from tests.clients.conftest import (API_KEY, CONTEXT, MODEL_ID, OUTPUT_CAP, OpenCode, add_key,
                                    base_url, key_sample, key_target, listed_keys,
                                    network_connections, occupied, occupied_place, pasted_env,
                                    rejections, responses_count, revoke_key, scraped_metrics,
                                    until)

# A first run installs the clients (scripts/install-clients); each client run is bounded.
pytestmark = pytest.mark.timeout(600)

CHAT = "/v1/chat/completions"


async def test_opencode_run_answers_with_the_models_text(start_studio, opencode: OpenCode):
    service = await start_studio(parallel=1)  # title and turn share one slot: may queue

    run = await opencode.run(service, "Say hello.")

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()
    assert responses_count(service, CHAT, 200) == 2  # title + turn, nothing re-sent


async def test_opencode_connects_to_nothing_but_the_port(start_studio, opencode: OpenCode,
                                                        strace, tmp_path):
    """Offline: no model catalogue, update check, share or plugin install reaches out
    (@opencode-ai/plugin is pre-installed in its config dir)."""
    service = await start_studio(parallel=2)
    trace = tmp_path / "opencode.strace"

    run = await opencode.run(service, "Say hello.", trace=trace)

    assert run.returncode == 0 and run.text, run.describe()
    connections = network_connections(trace)
    assert connections, "strace saw no connection at all"
    assert set(connections) == {("127.0.0.1", service.gateway_port)}, connections


async def test_opencode_retries_a_429_and_succeeds_once_a_place_frees(
        start_studio, opencode: OpenCode):
    service = await start_studio(parallel=1, max_queue=1)
    async with occupied(service):
        async with occupied_place(service) as waiting:
            process = await opencode.start(service, "Say hello.")
            await until(lambda: rejections(service, "server_is_overloaded") >= 1, 90,
                        "OpenCode's request to be refused")
            assert process.running
    await waiting

    run = await process.result()

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()
    assert responses_count(service, CHAT, 429) >= 1


async def test_opencode_sees_an_in_stream_queue_timeout_as_an_error_and_retries_later(
        start_studio, opencode: OpenCode):
    """A queue timeout after keep-alives began ends the stream with an in-stream error and
    [DONE]; OpenCode takes it as a failed attempt (no tight re-request loop), backs off,
    and its retry succeeds once the slot is free."""
    service = await start_studio(parallel=1)
    await service.apply_settings(service.settings.replace(queue_timeout=2))
    async with occupied(service):
        process = await opencode.start(service, "Say hello.")
        await until(lambda: rejections(service, "queue_timeout") >= 2, 90,
                    "OpenCode's queued requests to time out")
        await asyncio.sleep(1)
        timed_out_while_held = rejections(service, "queue_timeout")
        assert process.running

    run = await process.result()

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()
    # Backing off, not looping: a handful of attempts while the slot was held.
    assert timed_out_while_held <= 4, service.metrics.totals()


async def test_opencode_takes_the_snippets_models_limits_and_small_model(start_studio,
                                                                     opencode: OpenCode):
    """The OpenCode snippet of a port with two models, pasted as it is (plus the suite's
    no-update, no-share switches): the title and the turn both reach the port."""
    service = await start_studio(parallel=1)
    target = ClientTarget(base_url(service), MODEL_ID, API_KEY, context_length=CONTEXT,
                          max_output_tokens=OUTPUT_CAP, others=(ClientModel("never-asked-for", 4096),),
                          small_model=MODEL_ID)
    config = json.loads(opencode_snippet(target).text) | {"autoupdate": False, "share": "disabled"}

    run = await opencode.run(service, "Say hello.", config=config, env={KEY_ENV_VAR: API_KEY})

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()
    assert responses_count(service, CHAT, 200) == 2  # title (small_model) + turn


# --- named keys ------------------------------------------------------------------------------

async def run_with_key(opencode: OpenCode, service, secret: str, prompt: str = "Say hello.",
                       **kwargs):
    """OpenCode as the user sets it up for a named key: the OpenCode snippet made for that
    key's secret pasted as opencode.json (plus the suite's no-update, no-share switches),
    its `export` line run."""
    snippet = opencode_snippet(key_target(service, secret))
    assert secret not in snippet.text  # the file names the variable; the shell line sets it
    config = json.loads(snippet.text) | {"autoupdate": False, "share": "disabled"}
    return await opencode.start(service, prompt, config=config, env=pasted_env(snippet), **kwargs)


async def test_opencode_with_a_named_keys_snippet_answers_and_its_usage_shows_by_name(
        start_studio, opencode: OpenCode):
    service = await start_studio(parallel=1)
    secret = await add_key("ci-agent", "--max-concurrent", "1", "--priority", "batch")

    run = await (await run_with_key(opencode, service, secret)).result()

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()
    used = service.usage.usage("ci-agent")
    assert used.requests == 2 and used.completion_tokens == 2 * OUTPUT_CAP, used  # title + turn
    assert used.refusals == {}, used
    assert "owner" not in service.usage.snapshot()
    metrics = await scraped_metrics(service)
    assert key_sample(metrics, "gguf_studio_key_requests_total", "ci-agent") == 2
    assert key_sample(metrics, "gguf_studio_key_tokens_total", "ci-agent",
                      kind="prompt") == used.prompt_tokens
    listed = (await listed_keys(service))["ci-agent"]
    assert listed["usage"]["requests"] == 2 and listed["priority"] == "batch", listed


async def test_opencode_with_a_key_not_allowed_the_model_fails_clearly_and_other_keys_still_work(
        start_studio, opencode: OpenCode):
    service = await start_studio(parallel=1)
    narrow = await add_key("narrow", "--models", "other-*")
    alice = await add_key("alice")

    refused = await (await run_with_key(opencode, service, narrow)).result()
    served = await (await run_with_key(opencode, service, alice)).result()

    assert refused.returncode != 0 and not refused.timed_out, refused.describe()
    assert "may not use the model 'tiny'" in refused.stdout + refused.stderr, refused.describe()
    assert served.returncode == 0 and served.text, served.describe()
    narrow_used, alice_used = service.usage.usage("narrow"), service.usage.usage("alice")
    # The title and the turn, each refused once: OpenCode does not retry a 403.
    assert narrow_used.requests == 0 and narrow_used.refusals == {"model_not_allowed": 2}
    assert alice_used.requests == 2 and alice_used.refusals == {}
    metrics = await scraped_metrics(service)
    assert key_sample(metrics, "gguf_studio_key_refusals_total", "narrow",
                      reason="model_not_allowed") == 2
    assert responses_count(service, CHAT, 403) == 2


async def test_opencode_with_a_revoked_key_fails_clearly_and_other_keys_still_work(
        start_studio, opencode: OpenCode):
    """A key that worked, revoked with `gguf-studio keys revoke` while the port runs: the
    next run fails saying so, and another key's run is served as before."""
    service = await start_studio(parallel=1)
    alice = await add_key("alice")
    bob = await add_key("bob")
    before = await (await run_with_key(opencode, service, alice)).result()
    assert before.returncode == 0 and before.text, before.describe()

    await revoke_key(service, "alice")
    revoked = await (await run_with_key(opencode, service, alice)).result()
    served = await (await run_with_key(opencode, service, bob)).result()

    assert revoked.returncode != 0 and not revoked.timed_out, revoked.describe()
    assert "'alice' was revoked" in revoked.stdout + revoked.stderr, revoked.describe()
    assert served.returncode == 0 and served.text, served.describe()
    assert service.usage.usage("alice").requests == 2  # the run before the revocation
    assert service.usage.usage("bob").requests == 2 and service.usage.usage("bob").refusals == {}
    assert responses_count(service, CHAT, 401) == 2  # title and turn, neither retried
