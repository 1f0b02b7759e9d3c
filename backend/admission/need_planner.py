"""What one request will hold of an engine's KV cache, planned before admission.

`NeedPlanner` is built once per serving engine, from its `Serving` (cache, slots) and
the operator's `OutputPolicy`, with a `PromptCounter` that asks that engine.  Its
`plan(route, body, body_bytes)` gives a `Plan`:

- a short request is reserved at its byte bound, never counted (its bound plus budget
  fits its fair share of the cache, so reserving the bound costs no concurrency);
- a longer one whose bound fits right now, with nobody waiting (`fits_now`), is admitted
  on the bound and counted while it runs: `Plan.settle(ticket)` shrinks the reservation
  to the count, so the count's round trip no longer delays its first token;
- otherwise it is counted before it queues, as its bound may hold back others;
- a turn that continues its session's last one (`Continued`) is planned from that
  turn's count: its addition's bytes when short, else the engine's tokens of the added
  text alone, which is as good as a count of the whole prompt and far cheaper.

Without a known cache (or with admission off) there is no need: slots alone decide.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.admission.admission_ticket import Ticket
from backend.admission.hint import NO_HINT, Hint
from backend.admission.continued_turn import Continued
from backend.admission.prompt_tokens import (DEFAULT_OUTPUT_TOKENS, PromptCount, PromptCounter,
                                             output_budget, token_need)

__all__ = ["NO_PLAN", "NeedPlanner", "OutputPolicy", "Plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OutputPolicy:
    """The operator's output rules: `cap` is the ceiling of any request's output (0:
    none); `default` the budget reserved for a request that sends no limit."""

    cap: int = 0
    default: int = DEFAULT_OUTPUT_TOKENS


@dataclass(frozen=True, slots=True)
class Plan:
    """A request's need, whether it must be counted after admission, and what placement
    may read beside the need."""

    #: KV tokens it may hold (prompt + output budget); None: unknown, slots alone decide.
    need: TokenNeed | None = None
    #: Set when `need` is the prompt's byte bound, admitted before counting.
    count_later: Callable[[], Awaitable[TokenNeed]] | None = None
    #: Its session and prompt prefix (`backend.admission.hint.Hint`), for placement.
    hint: Hint = NO_HINT

    @property
    def settle_later(self) -> bool:
        return self.count_later is not None

    async def settle(self, ticket: Ticket) -> None:
        """Count the prompt of a request admitted on its byte bound and give back what
        the bound reserved beyond the count.  A failed count keeps the bound."""
        if self.count_later is None:
            return
        try:
            need = await self.count_later()
        except Exception:  # a bug: counting failures are estimates, never raised
            log.exception("counting the prompt of a running request failed; the byte "
                          "bound stays reserved")
            return
        if need.total > ticket.tokens:
            log.warning("a prompt counted %d tokens above its byte bound; the bound "
                        "stays reserved", need.total - ticket.tokens)
        ticket.settle(need)


NO_PLAN = Plan()


class NeedPlanner:
    """Plans the needs of requests for one serving engine."""

    def __init__(self, serving: Serving, counter: PromptCounter,
                 policy: OutputPolicy = OutputPolicy()) -> None:
        if serving.kv is None:
            raise ValueError("a need planner needs the engine's KV cache")
        self.serving = serving
        self.kv: KvCapacity = serving.kv
        self.counter = counter
        self.policy = policy

    async def plan(self, route: str, body: Mapping[str, Any], body_bytes: int, *,
                   fits_now: Callable[[TokenNeed], bool] = lambda need: False,
                   hint: Hint = NO_HINT, continued: Continued | None = None,
                   size: int | None | EllipsisType = ...) -> Plan:
        """The plan of one request of `body_bytes` bytes to `route`, carrying `hint`.
        `fits_now(need)`: would admission take a request of that need (and hint) at once,
        passing no one; `continued`: the turn it continues, whose prompt plans this one's
        where it is below the byte bound: counted from its addition alone, it needs no
        count of the whole prompt; `size`: the body's `prompt_size`, if read already."""
        bound = await self.bound_need(route, body, body_bytes, size=size)
        if continued is not None:
            prompt = await continued.count(self.counter)
            if bound is None or prompt.tokens < bound.prompt:
                if prompt.how == "continued":
                    return Plan(self._need(route, body, prompt), hint=hint)
                bound = self._need(route, body, prompt)
        if bound is not None:
            if bound.prompt <= self.uncounted_room(route, body):
                return Plan(bound, hint=hint)  # what `request_need` gives, without a second bound
            if fits_now(bound):
                return Plan(bound, lambda: self.counted_need(route, body, body_bytes), hint)
        return Plan(await self.request_need(route, body, body_bytes), hint=hint)

    async def request_need(self, route: str, body: Mapping[str, Any],
                           body_bytes: int) -> TokenNeed:
        """The need, counted by the engine unless the byte bound proves it fits its fair
        share (then the bound: reserving it cannot cost any concurrency)."""
        prompt = await self.counter.count(route, body, body_bytes,
                                          fits_below=self.uncounted_room(route, body))
        return self._need(route, body, prompt)

    def uncounted_room(self, route: str, body: Mapping[str, Any]) -> int:
        """The largest prompt bound that is reserved without counting: bound plus budget
        within one request's fair share of the cache (every slot's share of a unified
        pool, or its own slot of a split one), where reserving the bound costs no
        concurrency."""
        kv = self.kv
        share = min(kv.per_request, kv.total // max(1, self.serving.slots))
        budget = output_budget(route, body, prompt_tokens=0, limit=kv.per_request,
                               cap=self.policy.cap, default=self.policy.default)
        return max(0, share - budget)

    async def bound_need(self, route: str, body: Mapping[str, Any], body_bytes: int, *,
                         size: int | None | EllipsisType = ...) -> TokenNeed | None:
        """The need on the prompt's byte bound, without asking the engine; None where no
        bound holds.  Never below the counted need: the prompt's bound is at least its
        count, and a larger prompt leaves a budget no larger than the room it takes
        (`output_budget`), so the sum only grows with the prompt.  `size`: the body's
        `prompt_size`, if read already."""
        prompt = await self.counter.bound(route, body, body_bytes, size=size)
        if prompt is None:
            return None
        return self._need(route, body, PromptCount(prompt, "bound"))

    async def counted_need(self, route: str, body: Mapping[str, Any],
                           body_bytes: int) -> TokenNeed:
        """The need with the prompt counted by the engine (or its conservative estimate
        when the engine cannot count, which is the byte bound for a body that has one), for
        a request already running: it is never refused for a busy engine (it keeps its
        bound instead)."""
        prompt = await self.counter.count(route, body, body_bytes, refuse_when_busy=False)
        return self._need(route, body, prompt)

    def _need(self, route: str, body: Mapping[str, Any], prompt: PromptCount) -> TokenNeed:
        return token_need(route, body, prompt, limit=self.kv.per_request,
                          cap=self.policy.cap, default=self.policy.default)
