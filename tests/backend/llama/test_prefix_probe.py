"""What an attached llama-server keeps of a prompt, asked of real engines started with the
flags users start them with (the managed binary, the tiny model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backend.llama.api import EngineClient
from backend.llama.prefix_probe import probe_prefix_keeping
from backend.llama.supervisor import pick_free_port
from tests.backend.llama.test_remote_engine import start_llama_server, stop
from tests.not_none import not_none


@pytest.mark.parametrize(("flags", "slots", "finds_in_ram", "says"), [
    ((), 2, True, None),
    (("--slot-prompt-similarity", "1"), 2, True, None),
    (("--cache-ram", "0"), 2, False, "Start it with --slot-prompt-similarity 1 and without "
                                     "--cache-ram 0."),
    (("--slot-prompt-similarity", "0"), 2, False, "Start it with --slot-prompt-similarity 1 "
                                                  "and without --cache-ram 0."),
    (("--no-cache-prompt",), 2, False, "Start it without --no-cache-prompt."),
    ((), 1, True, None),  # one slot: sessions take turns in it, their prefixes in RAM
])
async def test_the_probe_says_which_flags_defeat_prefix_keeping_and_what_to_change(
        llama_server_binary: Path, tiny_model: Path, flags: tuple[str, ...], slots: int,
        finds_in_ram: bool, says: str | None) -> None:
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=slots,
                                extra=flags)
    try:
        async with EngineClient(f"http://127.0.0.1:{port}", timeout=60) as client:
            async with asyncio.timeout(60):
                await client.wait_healthy()
            keeping = not_none(await probe_prefix_keeping(client, slots))
    finally:
        stop(engine)
    assert keeping.finds_in_ram is finds_in_ram
    if says is None:
        assert keeping.warning is None
    else:
        assert not_none(keeping.warning).endswith(says)


async def test_an_engine_that_does_not_answer_completions_is_left_unprobed() -> None:
    async with EngineClient(f"http://127.0.0.1:{pick_free_port()}", timeout=2) as client:
        assert await probe_prefix_keeping(client, 2, time_limit=5) is None
