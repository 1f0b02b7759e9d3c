"""What an attached llama-server does with the prompts it held, found by asking it.

A plain llama-server says nothing in `/props` or `/slots` of the flags that decide whether
a session's prefix survives (the pinned sources, `get_res_props`: `total_slots`, the
per-slot `n_ctx`, the build; no `--slot-prompt-similarity`, `--cache-ram`,
`--cache-prompt` or `--kv-unified`).  So the port asks (`probe_prefix_keeping`): four
one-token `/completion` requests pinned to the engine's last slot,

1. prompt A, then A again: the second finds A in its slot unless the engine reuses no
   prompt at all (`--no-cache-prompt`);
2. prompt B (nothing in common with A), then A once more: pinned to a slot holding
   another prompt, llama-server saves that prompt to its RAM prompt cache and loads the
   best match for the new one (`get_available_slot`) -- unless the cache is off
   (`--cache-ram 0`) or the slot similarity is 0 (a pinned request then never consults
   it).  A found there means a session whose slot another took comes back, when the
   port sends its turn to a slot it has first vacated (`SlotClient.vacate`).

The probe costs the engine about 120 prompt tokens and moves what that slot held to its
RAM cache (on an engine whose similarity is 0, that slot's prompt is lost).  Its answer
(`PrefixKeeping`) tells placement whether to vacate slots for returning sessions
(`Serving.finds_prefix_in_ram`) and says what to change when the engine's flags defeat
prefix keeping (`warning`), for `/health`, the Pool tab's engine row and the log.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from backend.errors import StudioError
from backend.llama.api import EngineClient

__all__ = ["PROBE_TIME_LIMIT", "PrefixKeeping", "probe_prefix_keeping"]

#: Seconds the whole probe may take; an engine busy past it is left unprobed (nothing is
#: assumed of it, nothing said).
PROBE_TIME_LIMIT = 30.0

# Two prompts with nothing in common from their first word (about 30 tokens each): a
# slot similarity threshold cannot take one for the other.
_PROMPT_A = ("Apples and pears grow in the orchard behind the old mill, where the river "
             "bends twice before it reaches the quiet town by the hills.")
_PROMPT_B = ("Seven violet kites drift over cold harbour water while sailors mend grey "
             "nets and gulls argue loudly above the wooden pier.")


@dataclass(frozen=True, slots=True)
class PrefixKeeping:
    """What the probe saw an attached llama-server do with a prompt it held."""

    #: The same prompt sent again to its slot was taken from the cache.
    reuses_prompts: bool
    #: A prompt whose slot another took came back from the RAM prompt cache when sent to
    #: that slot again.
    finds_in_ram: bool

    @property
    def warning(self) -> str | None:
        """What defeats prefix keeping on this engine and what to change; None: nothing."""
        if not self.reuses_prompts:
            return ("This engine reuses no prompt (it runs with --no-cache-prompt): every "
                    "turn of every session computes its whole prompt. Start it without "
                    "--no-cache-prompt.")
        if not self.finds_in_ram:
            return ("This engine does not bring a prompt back from its RAM prompt cache "
                    "(--cache-ram 0, or --slot-prompt-similarity 0): a session whose slot "
                    "another took computes its whole prompt again. Start it with "
                    "--slot-prompt-similarity 1 and without --cache-ram 0.")
        return None


async def probe_prefix_keeping(engine: EngineClient, slots: int, *,
                               time_limit: float = PROBE_TIME_LIMIT) -> PrefixKeeping | None:
    """Ask the llama-server behind `engine` (of `slots` slots) what it keeps (see the
    module's doc); None when it did not answer as a llama-server does within
    `time_limit` seconds (busy, or no `/completion`)."""
    slot = max(0, slots - 1)
    try:
        async with asyncio.timeout(time_limit):
            await _complete(engine, _PROMPT_A, slot, time_limit)
            again = await _complete(engine, _PROMPT_A, slot, time_limit)
            await _complete(engine, _PROMPT_B, slot, time_limit)
            back = await _complete(engine, _PROMPT_A, slot, time_limit)
    except (TimeoutError, httpx.HTTPError, StudioError, ValueError):
        return None
    if again is None or back is None:
        return None
    return PrefixKeeping(reuses_prompts=_mostly_cached(again), finds_in_ram=_mostly_cached(back))


# --- helpers -------------------------------------------------------------------------------


async def _complete(engine: EngineClient, prompt: str, slot: int,
                    timeout: float) -> tuple[int, int] | None:
    """One token of `prompt` pinned to `slot`: its prompt tokens (from a cache, computed).
    Without `cache_prompt`: the engine's own default, as clients' requests have it."""
    answer: Any = await engine.post_json("/completion", {
        "prompt": prompt, "n_predict": 1, "id_slot": slot, "temperature": 0}, timeout=timeout)
    timings = answer.get("timings") if isinstance(answer, dict) else None
    if not isinstance(timings, dict):
        return None
    cached, computed = timings.get("cache_n"), timings.get("prompt_n")
    if not isinstance(cached, int) or not isinstance(computed, int):
        return None
    return cached, computed


def _mostly_cached(figures: tuple[int, int]) -> bool:
    """The engine found the prompt: all but its last tokens came from a cache (it always
    computes at least the last one again)."""
    cached, computed = figures
    return cached > 0 and computed * 4 < cached + computed
