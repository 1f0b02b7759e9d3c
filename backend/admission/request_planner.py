"""A request's admission, asked once: what it says of itself, its prompt, the turn it
continues and its plan (`RequestPlanner.admit` -> `Admission`).

The port reads and checks a request, then asks one question: `admit` reads its `Hint`
(its session and prompt prefix), its prompt's blocks (`prompt.read_prompt`, the body's one walk; its
size only for a session's turn, the one that may be continued), the turn of its session
it continues (from the turn book, `TurnBook.continuation`), and plans its need on its
model's planning engine (`need_planner`).  A request for a model that is loading has no
plan yet: once an engine serves, `plan_after_load` plans it from the same hint and blocks.

One `NeedPlanner` per serving engine, remade when the engine's cache or the output
policy changes; the engine's tokenizer comes from the factory the port hands in (an
`EngineTokenizer` over HTTP there): this module does no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, Protocol

from backend.admission.admission_registry import AdmissionRegistry
from backend.admission.cache_misses import TurnRecord
from backend.admission.continued_turn import Continued
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.hint import NO_HINT, Hint, request_hint
from backend.admission.line import Line
from backend.admission.need_planner import NO_PLAN, NeedPlanner, OutputPolicy, Plan
from backend.admission.prefill_budget import LONG_PREFILL_TOKENS
from backend.admission.prompt import Prompt, PromptBlocks, read_prompt
from backend.admission.prompt_bytes import prompt_size
from backend.admission.prompt_tokens import EngineTokenizer, PromptCounter
from backend.api_paths import COUNT_ROUTES, MESSAGES
from backend.llama.kv_capacity import TokenNeed
from backend.llama.load import Serving
from backend.settings import Settings

__all__ = ["Admission", "RequestPlanner", "TokenizerFactory", "TurnBook"]

#: Makes the tokenizer of a serving engine (the port's, over HTTP), for its counter.
TokenizerFactory = Callable[[Serving], EngineTokenizer]


class TurnBook(Protocol):
    """Where a session's answered turns are kept: the one answer planning needs."""

    def continuation(self, session: str | None, model: str,
                     blocks: PromptBlocks) -> TurnRecord | None:
        """The answered turn of `session` on `model` that a prompt of `blocks` continues
        (the same request with messages added); None when there is none."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What the port's exchange needs of a request's admission."""

    #: What it will hold of the engine's cache; None while no engine serves its model
    #: (it is loading): `RequestPlanner.plan_after_load` plans it once one does.
    plan: Plan | None
    #: Its session and prompt prefix, for placement.
    hint: Hint
    #: Its prompt's blocks, to say why its answer's prompt missed the cache (if it did).
    blocks: PromptBlocks


class RequestPlanner:
    """Admits the requests of one port: their hints, blocks and plans."""

    def __init__(self, registry: AdmissionRegistry, book: TurnBook,
                 tokenizer_for: TokenizerFactory, settings: Callable[[], Settings]) -> None:
        self._registry = registry
        self._book = book
        self._tokenizer_for = tokenizer_for
        self._settings = settings  # read per request: they may change while the port runs
        # Engine key -> its need planner (and prompt counter); see `planner_for`.
        self._planners: dict[str, NeedPlanner] = {}

    async def admit(self, line: Line[AdmissionQueue], route: str, model: str, flow: str,
                    headers: Iterable[tuple[bytes, bytes]], data: Mapping[str, Any],
                    body_bytes: int) -> Admission:
        """The admission of a request to `route` for `model` (resolved, its line `line`)
        from flow `flow`, with these headers and parsed body of `body_bytes` bytes."""
        # The body's prompt, read once: its hint and its blocks read the same parts.
        prompt = read_prompt(data)
        hint = request_hint(flow, headers, data, pinnable=route != MESSAGES, prompt=prompt)
        # Its size (a walk of its messages for images and tool calls) bounds a chat-like
        # prompt, and a session's turn that the next continues: read once for both.
        size = (prompt_size(data, body_bytes)
                if route in COUNT_ROUTES or hint.session is not None else None)
        blocks = prompt.blocks(size)
        queue = line.planning_engine
        if queue is None:  # the model is loading: planned once it is served
            return Admission(None, hint, blocks)
        continued = self._continued(hint, model, blocks, data, prompt)
        del prompt  # its parts hold the body's texts: not kept while it is planned
        plan = await self._plan(queue, route, data, body_bytes, hint, continued, size)
        return Admission(plan, hint, blocks)

    async def plan_after_load(self, line: Line[AdmissionQueue], route: str, model: str,
                              data: Mapping[str, Any], body_bytes: int, hint: Hint,
                              blocks: PromptBlocks) -> Plan:
        """The plan of a request admitted while its model was loading (`admit` gave it
        `hint` and `blocks`), now that an engine serves it (no need if none does still)."""
        queue = line.planning_engine
        if queue is None:
            return Plan(hint=hint)
        return await self._plan(queue, route, data, body_bytes, hint,
                                self._continued(hint, model, blocks, data))

    def planner_for(self, queue: AdmissionQueue) -> NeedPlanner | None:
        """One planner per serving engine, counting with that engine (it knows its
        template); remade when the engine's cache or the output policy changes.  None
        when the cache is unknown or admission is off."""
        serving = queue.serving
        if serving.kv is None or not queue.enabled:
            return None
        settings = self._settings()
        planner = self._planners.get(serving.key)
        if (planner is None or planner.serving is not serving
                or planner.policy.cap != settings.max_output_tokens
                or planner.policy.default != settings.default_output_tokens):
            counter = planner.counter if planner is not None else PromptCounter(
                self._tokenizer_for(serving))
            planner = self._planners[serving.key] = NeedPlanner(
                serving, counter, OutputPolicy(settings.max_output_tokens,
                                               settings.default_output_tokens))
            registry = self._registry
            for key in [k for k in self._planners if registry.queue_for(k) is None]:
                del self._planners[key]
        # Its cap of counts at once follows the settings live; it counts for its model's
        # whole line (`Line.planning_engine`), so the cap follows the line's slots.
        planner.counter.max_counts = settings.effective_max_prompt_counts(queue.line.capacity)
        return planner

    # --- helpers -------------------------------------------------------------------------

    def _continued(self, hint: Hint, model: str, blocks: PromptBlocks,
                   data: Mapping[str, Any], prompt: Prompt | None = None) -> Continued | None:
        """The turn of its session's last answered one on this model that the request of
        parsed body `data` (its prompt read: `prompt`, else read here if needed)
        continues (`continued_turn.Continued`), planned from it; None when it continues
        none.  An addition of `LONG_PREFILL_TOKENS` bytes or more
        brings its text, for the engine to count it alone: on its bytes (about 4 a
        token) it would over-reserve, and read as a long cold prompt to the prefill
        budget, which sent warm turns away from their prefix's engine in a pool."""
        earlier = self._book.continuation(hint.session, model, blocks)
        if earlier is None:
            return None
        added = blocks.size - earlier.blocks.size
        text = "" if added < LONG_PREFILL_TOKENS else \
            (read_prompt(data) if prompt is None else prompt).text_after(earlier.blocks.chars)
        return Continued(earlier.prompt_tokens, added, text)

    async def _plan(self, queue: AdmissionQueue, route: str, data: Mapping[str, Any],
                    body_bytes: int, hint: Hint, continued: Continued | None,
                    size: int | None | EllipsisType = ...) -> Plan:
        """What the request will hold of the engine's KV cache (`NeedPlanner`), and its
        `hint`; no need when the cache is unknown or admission is off: slots alone
        decide, or nothing.  `continued`: the turn it continues, if any; `size`: its
        body's `prompt_size`, if read already."""
        planner = self.planner_for(queue)
        if planner is None:
            return NO_PLAN if hint is NO_HINT else Plan(hint=hint)
        line = queue.line
        fits_now: Callable[[TokenNeed], bool] = line.fits_now
        if hint is not NO_HINT:
            def fits_now(need: TokenNeed) -> bool:
                return line.fits_now(need, hint)
        return await planner.plan(route, data, body_bytes, fits_now=fits_now, hint=hint,
                                  continued=continued, size=size)
