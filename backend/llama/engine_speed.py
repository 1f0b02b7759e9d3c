"""How fast an engine computes prompts and steps, measured after each healthy load, and
the batch size a stall budget asks for.

llama-server runs every running stream and the prompts being computed in the same steps
(tools/server/server-context.cpp, `update_slots`): each step gives every generating slot
one token, then fills the batch with prompt tokens up to `n_batch`, decodes it (split in
micro-batches of `n_ubatch`), and only then sends the streams their next token.  So a
stream beside a long prompt waits, for each of its chunks, the time the engine takes to
compute `n_batch` prompt tokens at their depth in the context: with the default 2048 on
a CPU that is seconds.  The stall budget bounds that wait: the batch is the largest whose
step, at the deepest position a slot reaches, stays within it.

`measure_speed` asks the engine (four small `/completion`s, before the load is
published, so no client shares it): a fresh prompt of `n` tokens, twice (the first after
a load also pays for the warm-up); a prompt of `depth` tokens kept in slot 0's cache; the
same prompt plus `n` fresh tokens, evaluated at that depth and then decoded for a few
tokens.  A prompt token's cost grows with its depth
(attention reads every earlier token), so the two times give its cost at depth 0 and its
growth per token of depth (`SpeedModel`), from which `choose_batch` predicts a step of any
size at any depth.  The choice needs a restart of the engine (the batch is fixed at its
start, `llama_n_batch` of its context: no request can change it); the supervisor keeps
each load's measure, so the restart happens once per load settings (see
`backend.llama.supervisor`).

A step costs more than its tokens: each micro-batch pays a fixed cost (the weights read
once, the graph; about a decode step), and the streams' own tokens go in a micro-batch of
their own (llama.cpp splits a batch by sequence when each slot has its own cache).  And a
batch is not worth its tokens alone: llama.cpp's CPU flash attention computes a prompt's
rows in tiles of 64 (`ATTENTION_TILE`), each costing a whole tile's work at that depth
however few rows it holds, and one row at a time below 64.  So the batch is a whole
number of tiles, large enough that the prompt keeps 64 rows beside the other slots'
tokens; within that, the largest the stall budget allows (and the smallest when none
does: the streams then stall longer than the budget anyway).  Measured with SmolLM2
(Q4_1, one thread) at depth 6,000, prompt tokens/s: 41-53 at `-b 2048`, 41-42 at 128,
36 at 64, 5.4 at 32, and 3.7 at 64 with three streams decoding beside (the prompt's
rows: 61); 18 at 68 and 24 at 96 (two tiles each, half and three quarters full).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from backend.llama.api import EngineClient

__all__ = ["ATTENTION_TILE", "DEFAULT_BATCH", "DEFAULT_STALL_BUDGET", "DEFAULT_UBATCH",
           "BatchChoice", "EngineSpeed", "SpeedModel", "choose_batch", "fit_speed",
           "measure_speed", "smallest_batch", "user_batch"]

log = logging.getLogger("gguf_studio.engine_speed")

#: llama-server's own batch and micro-batch sizes (common/common.h).
DEFAULT_BATCH = 2048
DEFAULT_UBATCH = 512
#: The longest a running stream may wait for one step, in seconds, by default.
DEFAULT_STALL_BUDGET = 0.25
#: Rows of one sequence llama.cpp's CPU flash attention computes together
#: (GGML_FA_TILE_Q, ggml-cpu/common.h): a tile costs 64 rows' work at its depth however
#: many it holds, and a sequence with fewer than 64 rows in a micro-batch is computed one
#: query at a time, 7x slower per token at depth 6,000 (SmolLM2 here).  Batches are whole
#: tiles.
ATTENTION_TILE = 64
#: Prompt tokens of the calibration's chunks, and the depth of the deep one.
CALIBRATION_TOKENS = 128
CALIBRATION_DEPTH = 512
#: Tokens decoded to time a step.
CALIBRATION_STEPS = 8

BATCH_FLAGS = frozenset({"-b", "--batch-size"})
UBATCH_FLAGS = frozenset({"-ub", "--ubatch-size"})


@dataclass(frozen=True)
class SpeedModel:
    """Seconds a prompt token costs: `per_token` at depth 0, plus `per_depth` for each
    token of context before it; and a decode step of one stream, which is also the fixed
    cost of any micro-batch (the weights read once, the graph)."""

    per_token: float
    per_depth: float
    step: float

    def chunk_seconds(self, tokens: int, depth: int) -> float:
        """A step carrying `tokens` prompt tokens starting at `depth`, with streams decoding
        beside them: the prompt's micro-batch (its fixed cost and its tokens) and the
        streams' own."""
        return tokens * (self.per_token + self.per_depth * (depth + tokens / 2)) + 2 * self.step

    def speed_share(self, tokens: int) -> float:
        """The share of the engine's best prefill speed (every fixed cost spread over
        many tokens) that steps of `tokens` prompt tokens keep beside streams, at depth 0,
        where the fixed costs weigh most (whole attention tiles assumed)."""
        work = tokens * self.per_token
        return work / (work + 2 * self.step) if work > 0 else 0.0


@dataclass(frozen=True)
class BatchChoice:
    """The batch and micro-batch the engine runs with, and why, for people."""

    batch: int
    ubatch: int
    reason: str
    #: The user's own -b/-ub (extra arguments): they win.
    user_given: bool = False

    def args(self) -> list[str]:
        return ["--batch-size", str(self.batch), "--ubatch-size", str(self.ubatch)]


@dataclass(frozen=True)
class EngineSpeed:
    """What an engine was measured at after its load, and the batch it runs with."""

    #: Prompt tokens per second of a fresh prompt at the engine's batch size.
    prefill_tokens_per_second: float
    #: One decode step of one stream, in seconds.
    step_seconds: float
    model: SpeedModel
    choice: BatchChoice
    #: A step carrying a full batch at the deepest position, predicted (seconds).
    worst_step_seconds: float

    def to_dict(self) -> dict[str, object]:
        return {"prefill_tokens_per_second": round(self.prefill_tokens_per_second, 1),
                "step_ms": round(self.step_seconds * 1000, 1),
                "batch": self.choice.batch, "ubatch": self.choice.ubatch,
                "worst_step_ms": round(self.worst_step_seconds * 1000, 1),
                "batch_reason": self.choice.reason}

    def describe(self) -> str:
        return (f"Prompts at {self.prefill_tokens_per_second:,.0f} tokens/s, a step "
                f"{self.step_seconds * 1000:,.0f} ms; batch {self.choice.batch} "
                f"(micro-batch {self.choice.ubatch}): {self.choice.reason}")


def user_batch(extra_args: tuple[str, ...] | list[str]) -> tuple[int | None, int | None]:
    """The -b and -ub a user's extra arguments give (the last of each wins), else None."""
    batch = ubatch = None
    args = list(extra_args)
    for i, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        value = inline if inline else (args[i + 1] if i + 1 < len(args) else "")
        if name in BATCH_FLAGS:
            batch = _positive_int(value) or batch
        elif name in UBATCH_FLAGS:
            ubatch = _positive_int(value) or ubatch
    return batch, ubatch


def smallest_batch(slots: int) -> int:
    """The smallest batch worth running beside `slots` slots: whole attention tiles,
    enough that a prompt keeps a tile's rows beside one decoding token of each other slot
    (a smaller one computes the prompt one row at a time, several times slower at depth)."""
    return _whole_tiles(ATTENTION_TILE + max(0, slots - 1))


def choose_batch(model: SpeedModel | None, *, budget: float, slots: int, context: int,
                 extra_args: tuple[str, ...] | list[str] = ()) -> BatchChoice:
    """The batch for an engine of `slots` slots of `context` tokens each, measured as
    `model`, so that a step carrying a prompt chunk at the deepest position stays within
    `budget` seconds (0: no budget).  A user's -b/-ub win.  The largest batch within the
    budget is chosen because a smaller one only costs prefill speed (more steps, each
    with the streams' tokens and the micro-batch's fixed costs), and never one that leaves
    a prompt less than an attention tile beside the other slots' tokens
    (`smallest_batch`): when no batch meets the budget, that one."""
    batch, ubatch = user_batch(extra_args)
    if batch is not None or ubatch is not None:
        b = batch or DEFAULT_BATCH
        return BatchChoice(b, ubatch or min(DEFAULT_UBATCH, b),
                           "the extra arguments set it (the stall budget does not apply)", True)
    if budget <= 0:
        return BatchChoice(DEFAULT_BATCH, DEFAULT_UBATCH, "the engine's default (no stall budget)")
    if slots <= 1:
        return BatchChoice(DEFAULT_BATCH, DEFAULT_UBATCH,
                           "the engine's default: with one slot no stream waits beside a prompt")
    if model is None:
        return BatchChoice(DEFAULT_BATCH, DEFAULT_UBATCH,
                           "the engine's default: its speed could not be measured")
    floor = smallest_batch(slots)
    best = 0
    size = floor
    while size <= DEFAULT_BATCH:
        if model.chunk_seconds(size, max(0, context - size)) <= budget:
            best = size
        size += ATTENTION_TILE
    ms = budget * 1000
    if best >= DEFAULT_BATCH or floor >= DEFAULT_BATCH:
        return BatchChoice(DEFAULT_BATCH, DEFAULT_UBATCH,
                           f"the engine's default: a full batch stays within the {ms:g} ms "
                           "stall budget" if best else "the engine's default: too many slots "
                           "for a smaller batch to keep a prompt's attention tiles whole")
    if best == 0:
        worst = model.chunk_seconds(floor, max(0, context - floor)) * 1000
        return BatchChoice(floor, floor,
                           f"the smallest that keeps a prompt on whole attention tiles beside "
                           f"the other slots' streams: the {ms:g} ms stall budget cannot be met "
                           f"at the end of a context of {context:,} tokens (a step of {floor} "
                           f"prompt tokens there: about {worst:,.0f} ms), and a smaller batch "
                           "would compute prompts several times slower for a stall shorter by "
                           "its fixed costs only")
    return BatchChoice(best, best,
                       f"the largest whose step stays within the {ms:g} ms stall budget at "
                       f"the end of a context of {context:,} tokens (a larger one computes prompts "
                       "faster but stalls the other streams longer)")


def fit_speed(cold: dict[str, Any], deep: dict[str, Any], *,
              depth: int) -> tuple[SpeedModel, float] | None:
    """The `SpeedModel` and the prefill tokens/s of the calibration's timings (llama-server's
    `timings` of a cold chunk, and of a chunk `depth` tokens deep that then decoded a few
    tokens), or None when they are unusable.  Each chunk is one micro-batch, whose fixed
    cost (about a decode step) is not its tokens' cost: counting it per token would
    overstate what a token costs, and understate what a larger batch saves."""
    t0, n0 = cold["prompt_ms"] / 1000, cold["prompt_n"]
    td, nd = deep["prompt_ms"] / 1000, deep["prompt_n"]
    if n0 <= 0 or nd <= 0 or t0 <= 0:
        return None
    steps = deep.get("predicted_n") or 0
    step = deep["predicted_ms"] / 1000 / steps if steps > 1 else t0 / n0
    fixed = min(step, t0 / 2)  # a noisy step must not take the chunk's whole time
    cold_token = (t0 - fixed) / n0
    deep_token = max(0.0, td - fixed) / nd
    per_depth = max(0.0, (deep_token - cold_token) / max(1, depth))
    per_token = max(1e-7, cold_token - per_depth * n0 / 2)
    return SpeedModel(per_token, per_depth, step), n0 / t0


async def measure_speed(client: EngineClient, *, context: int, vocabulary_text: str = "",
                        timeout: float = 120.0) -> tuple[SpeedModel, float] | None:
    """The engine's `SpeedModel` and its prefill tokens/s, or None when it cannot be
    measured (too small a context, an engine that does not complete)."""
    tokens = min(CALIBRATION_TOKENS, context // 4)
    depth = min(CALIBRATION_DEPTH, context // 2)
    if tokens < 16 or depth < 2 * tokens:
        return None
    try:
        words = await client.tokenize(vocabulary_text or _TEXT)
        if not words:
            return None
        stamp = int(time.monotonic_ns()) % 9973
        base = _tokens(words, depth, offset=stamp)
        fresh = _tokens(words, tokens, offset=stamp + 11)
        # The first computation after a load also pays for its warm-up (pages of weights
        # read in, threads started): a cold chunk measured then looks dearer than a deep
        # one, hiding what depth costs.  The cheaper of two is the chunk's own cost.
        colds = [await _completion(client, _tokens(words, tokens, offset=stamp + shift),
                                   n_predict=1, slot=0, cache=False, timeout=timeout)
                 for shift in (3, 7)]
        cold = min(colds, key=lambda timings: timings["prompt_ms"] / max(1, timings["prompt_n"]))
        await _completion(client, base, n_predict=1, slot=0, cache=True, timeout=timeout)
        deep = await _completion(client, base + fresh, n_predict=CALIBRATION_STEPS, slot=0,
                                 cache=True, timeout=timeout)
    except Exception as exc:  # measuring is best effort: the load serves without it
        log.warning("could not measure the engine's speed: %s", exc)
        return None
    return fit_speed(cold, deep, depth=len(base) + len(fresh) - deep["prompt_n"])


# --- helpers ------------------------------------------------------------------------------

_TEXT = ("The river carried copper lanterns past the orchard while a falcon circled the "
         "glacier, and the harbor signal blinked over velvet meadows of thistle and saffron.")


def _tokens(words: list[int], n: int, offset: int) -> list[int]:
    return [words[(offset + i * 7) % len(words)] for i in range(n)]


async def _completion(client: EngineClient, prompt: list[int], *, n_predict: int, slot: int,
                      cache: bool, timeout: float) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": n_predict, "cache_prompt": cache, "id_slot": slot,
            "ignore_eos": True, "temperature": 0, "stream": False}
    answer = await client.post_json("/completion", body, timeout=timeout)
    timings = answer.get("timings") if isinstance(answer, dict) else None
    if not isinstance(timings, dict) or not isinstance(timings.get("prompt_ms"), (int, float)):
        raise ValueError("the engine's answer has no timings")
    return timings


def _whole_tiles(tokens: int) -> int:
    return -(-tokens // ATTENTION_TILE) * ATTENTION_TILE


def _positive_int(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None
