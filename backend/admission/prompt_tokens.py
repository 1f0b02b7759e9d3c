"""How many KV tokens a gated request needs: its prompt, counted by the engine, plus
its output budget.

Counting asks llama-server itself, so the model's own chat template and tokenizer
decide, tools, system prompts and images included:

- chat completions, Responses and Anthropic messages: llama-server's counting routes
  (`/v1/chat/completions/input_tokens`, `/v1/responses/input_tokens`,
  `/v1/messages/count_tokens`).  They run the very conversion, template and
  tokenization of a real request (Responses `input` items and `instructions`,
  Anthropic `system` and content blocks and `tools` become chat messages in C++,
  exactly as for generation), with the special tokens a real prompt gets (BOS), and
  without touching a slot.  An engine without those routes (an older attached one)
  is asked for `/apply-template` then `/tokenize` for chat completions.
- completions and embeddings: `/tokenize` with `add_special` (BOS, as a real prompt)
  for strings; token arrays are counted as they are.  An array of several embeddings
  inputs counts as the sum of them (llama-server runs them as separate tasks; summing
  can only over-reserve); completions take one prompt (`backend.port.request_fields`).

The engine is asked through the `EngineTokenizer` a counter is given (over llama-server's
HTTP routes: `backend.port.tokenizer_client.HttpEngineTokenizer`): the rules here do no
I/O of their own.

Short requests skip the engine when a byte bound proves they fit (`PromptCounter.count`
with `fits_below`): every tokenizer llama.cpp has for text models makes a token of at
least one byte of the text it was given (byte-level BPE; SentencePiece with byte
fallback and a vocabulary holding the "▁" space piece, as every llama-family vocabulary
does, where one space becomes one "▁" symbol), apart from at most `TEXT_SLACK` added
tokens (BOS/EOS, the SentencePiece dummy prefix).  For a chat-like body without images,
the template adds, per message, fewer tokens than the 29 bytes of
`{"role":"user","content":""}` that the JSON spends on it, plus a fixed part (generation
prompt, a default system prompt, a date) that is measured once per engine by counting
a one-message conversation (`template_base`).  What a template may render larger than
the body holds is added: each tool call's arguments at their indented size (templates
may parse and re-indent them), and for tools, measured once per engine with two probe
tools (`ToolCosts`), the fixed tool-use instructions plus, per tool, its wrapper and
its JSON indented by 4 with non-ASCII escaped (the largest JSON templates render; the
tool's bytes in the body are not counted twice).  So:

    prompt tokens <= body bytes + template_base + tool allowances + TEXT_SLACK

A request whose bound fits is reserved at its bound (an over-reservation, small because
the request is short).  A longer one whose bound fits the free cache right now, with
nobody waiting, is admitted on it and counted while it runs; only when the bound does
not fit now is the count awaited before admission (`backend.admission.need_planner` plans
which).  Images have no bound: their bytes say nothing.

Counting is work done before any queue bound holds, so `PromptCounter.max_counts` caps
the counts asked of one engine at once: past it a request that would wait for its count
is refused (`CountingFull`, 429), one already running keeps its bound.

When the engine cannot answer (an error, a timeout, a missing route) the count falls
back to a conservative estimate, logged once per counter: the byte bound where one is
known; else the body's bytes (without image payloads), the tool definitions' bytes once
more (templates may pretty-print them), `IMAGE_TOKENS` per image, and the template's
fixed part (measured, else `TEMPLATE_ALLOWANCE`).

The output budget (`output_budget`) is the request's one output limit (the one the
gateway writes into the body, `backend.admission.output_limits.output_limit`) or the default
budget, capped by the room the prompt leaves in one request's share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, Protocol

from backend.api_paths import CHAT, COMPLETIONS, COUNT_ROUTES, EMBEDDINGS
from backend.errors import CountingFull
from backend.llama.kv_capacity import TokenNeed
from backend.admission.output_limits import output_limit
from backend.admission.prompt_bytes import (IMAGE_TOKENS, compact_json, images_in, indented_bytes,
                                         prompt_size, split_prompts)

__all__ = [
    "DEFAULT_OUTPUT_TOKENS",
    "MIN_OUTPUT_TOKENS",
    "TEMPLATE_ALLOWANCE",
    "TEXT_SLACK",
    "CountFailed",
    "EngineTokenizer",
    "PromptCount",
    "PromptCounter",
    "ToolCosts",
    "output_budget",
    "token_need",
]

log = logging.getLogger(__name__)

#: The output budget of a request that sends no limit of its own (Codex sends none).
#: Admission reserves prompt + budget, so the default decides how many such requests
#: share a unified cache: every slot stays busy while each need fits its fair share
#: (context / slots).  With 2,048: at 16,384 tokens on 4 slots (a 16k model with Auto
#: slots) prompts of up to 2,048 tokens run 4 at once, at 32,768 on 4 slots up to 6,144;
#: with 4,096 the first case never runs 4 at once, and with 8,192 the second neither.
#: The risk on the other side: a reply longer than its budget.  If the gateway forwards
#: the budget as the request's limit, such a reply ends with finish reason "length";
#: if it only reserves, the reply uses tokens nobody reserved, which is harmless while
#: the pool has slack and fails only when every running request overruns together.
#: 2,048 holds most agent turns (tool calls, a patch of ~150 lines, a summary); long
#: reasoning may need more.  The gateway only reserves it (only a request's own limit,
#: or the operator's cap, is written into requests): see bench/README.md for why and
#: the figures.
#: Settings.default_output_tokens overrides it.
DEFAULT_OUTPUT_TOKENS = 2048
#: The least output a request is admitted with: a prompt that leaves less room in its
#: share of the context is refused rather than answered with a reply cut off at once.
MIN_OUTPUT_TOKENS = 16
#: Tokens a tokenizer may add to any text beyond one per byte (BOS, EOS, dummy prefix).
TEXT_SLACK = 4
#: The template's fixed part when it could not be measured: generous, since some
#: templates add a default system prompt with a date and tool-use instructions.
TEMPLATE_ALLOWANCE = 1024

#: Bytes llama-server may add to a tool when it converts a Responses or messages tool
#: to a chat one (`"type": "function"`, `"function": {...}`, `"strict": true`).
TOOL_CONVERSION = 64
#: Retry-After of a request refused while the engine counts `max_counts` prompts.
BUSY_RETRY_AFTER = 1.0

#: Tool sets whose allowance a counter keeps (`PromptCounter._tools_extra`).
_TOOL_SETS = 64
_PROBE = {"messages": [{"role": "user", "content": "x"}]}
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": name, "description": "x", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
    for name in ("a", "b")]


class CountFailed(Exception):
    """The engine could not count (unreachable, an error, a timeout).

    `missing` is True when the engine answered that it has no such route.
    """

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


class EngineTokenizer(Protocol):
    """What counting needs of an engine.  Each method raises CountFailed."""

    async def count_input_tokens(self, route: str, body: Mapping[str, Any]) -> int:
        """Prompt tokens of a chat, Responses or messages `body` for `route`."""

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        """The prompt text the chat template makes of a chat completions body."""

    async def tokenize(self, text: str) -> int:
        """Tokens of `text` as a prompt (with BOS and special tokens parsed)."""


@dataclass(frozen=True, slots=True)
class PromptCount:
    tokens: int
    #: "engine" (counted by it), "exact" (token arrays), "bound" (byte bound, short
    #: request), "continued" (a continued turn's addition counted by it:
    #: `continued_turn.Continued`)
    #: or "estimate" (the engine could not count).
    how: str


@dataclass(frozen=True, slots=True)
class ToolCosts:
    """What a template adds for tools, measured on the engine: `fixed` tokens once
    (tool-use instructions) and `per_tool` around each tool's JSON (an upper bound)."""

    fixed: int
    per_tool: int

    def allowance(self, tools: list[Any]) -> int:
        """An upper bound of the tokens `tools` take in a prompt (see `_known_bound`)."""
        return self.fixed + sum(self.per_tool + indented_bytes(tool) + TOOL_CONVERSION
                                for tool in tools)


class PromptCounter:
    """Counts prompts for one engine load; remembers its template's fixed parts.

    `max_counts` caps the counts it asks the engine for at once (0: no cap): past it a
    request that waits for its count is refused (CountingFull, 429), and one already
    running keeps its byte bound (`count(..., refuse_when_busy=False)`).  Counting is
    work done before admission, for requests no queue bound holds yet."""

    def __init__(self, tokenizer: EngineTokenizer, *, timeout: float = 10.0,
                 max_counts: int = 0) -> None:
        self.tokenizer = tokenizer
        self.timeout = timeout
        self.max_counts = max_counts
        #: Counts asked of the engine and not answered yet.
        self.counting = 0
        #: Tokens of a one-message conversation of one byte (an upper bound of the
        #: template's fixed part); None until measured.
        self.template_base: int | None = None
        #: What tools add to a prompt (`ToolCosts`); None until measured.
        self.tool_costs: ToolCosts | None = None
        self._calibrating: asyncio.Future[int | None] | None = None
        self._calibrating_tools: asyncio.Future[ToolCosts | None] | None = None
        self._logged_fallback = False
        #: Tools' compact JSON -> what they take beyond it (`_tools_extra`).
        self._tool_sets: dict[str, int] = {}

    async def count(self, route: str, body: Mapping[str, Any], body_bytes: int, *,
                    fits_below: int = 0, refuse_when_busy: bool = True) -> PromptCount:
        """Prompt tokens of a parsed `body` of `body_bytes` bytes sent to `route`.

        `fits_below`: when the byte bound proves the prompt is at most this many
        tokens, the bound is returned without asking the engine (0: always count).
        When `max_counts` counts are under way: CountingFull, or the conservative
        estimate if not `refuse_when_busy`.
        """
        if route in COUNT_ROUTES:
            return await self._count_chat_like(route, body, body_bytes, fits_below,
                                               refuse_when_busy)
        if route in (COMPLETIONS, EMBEDDINGS):
            field = "prompt" if route == COMPLETIONS else "input"
            return await self._count_prompts(body.get(field), fits_below, refuse_when_busy)
        raise ValueError(f"no prompt to count on {route}")

    async def bound(self, route: str, body: Mapping[str, Any], body_bytes: int, *,
                    size: int | None | EllipsisType = ...) -> int | None:
        """The byte bound of the prompt without counting it (the template's fixed parts
        are measured once per counter); None where no bound holds: images, or the
        template could not be measured.  `size`: the body's `prompt_size`, when the
        caller read it already (its walk of the body is not made twice)."""
        if route in COUNT_ROUTES:
            return await self._chat_bound(
                body, prompt_size(body, body_bytes) if size is ... else size)
        if route in (COMPLETIONS, EMBEDDINGS):
            texts, exact = split_prompts(body.get("prompt" if route == COMPLETIONS
                                                   else "input"))
            return exact + sum(len(t.encode()) + TEXT_SLACK for t in texts)
        return None

    async def count_text(self, text: str) -> int | None:
        """The engine's tokens of `text` alone; None when it cannot answer or is counting
        `max_counts` prompts already (the caller then keeps its bound)."""
        if self.busy:
            return None
        try:
            with self._asking():
                async with _deadline(self.timeout):
                    return await self.tokenizer.tokenize(text)
        except CountFailed as error:
            self._log_fallback(error)
            return None

    @property
    def busy(self) -> bool:
        """Whether a count asked now would be one more than `max_counts`."""
        return 0 < self.max_counts <= self.counting

    # --- chat, Responses, messages -------------------------------------------------

    async def _chat_bound(self, body: Mapping[str, Any], size: int | None) -> int | None:
        """The bound of a body of `prompt_size` `size`, measuring the template's parts it
        needs first."""
        if size is None or await self._template_base() is None:
            return None
        if body.get("tools") and await self._tool_costs() is None:
            return None
        return self._known_bound(body, size)

    def _known_bound(self, body: Mapping[str, Any], size: int | None) -> int | None:
        """The bound of a body of `prompt_size` `size` (None: it has images) from what is
        measured already; None if that is not enough.

        Without tools, the template adds per message fewer tokens than the JSON spends
        on it (see the module's docstring), and a tool call's arguments, which a
        template may re-indent, get their indented size once more.  Tools are rendered
        by templates as JSON (indented by at most 4, with or without `\\u` escapes)
        inside a fixed wrapper, plus fixed instructions: both wrappers are measured
        (`ToolCosts`), and each tool's JSON counts at its indented, escaped size in
        place of the bytes it takes in the body."""
        base = self.template_base
        if base is None or size is None:
            return None
        extra = 0
        tools = body.get("tools")
        if tools:
            if self.tool_costs is None or not isinstance(tools, list):
                return None
            extra += self._tools_extra(self.tool_costs, tools)
        return size + base + extra + TEXT_SLACK

    def _tools_extra(self, costs: ToolCosts, tools: list[Any]) -> int:
        """What `tools` may take in a prompt beyond their bytes in the body: an agent sends
        the same tools with every request, so this is kept by their JSON (at most
        `_TOOL_SETS` sets: a new set past it starts the memory over)."""
        compact = compact_json(tools)
        extra = self._tool_sets.get(compact)
        if extra is None:
            if len(self._tool_sets) >= _TOOL_SETS:
                self._tool_sets.clear()
            extra = self._tool_sets[compact] = costs.allowance(tools) - len(compact.encode())
        return extra

    async def _count_chat_like(self, route: str, body: Mapping[str, Any], body_bytes: int,
                               fits_below: int, refuse_when_busy: bool) -> PromptCount:
        size = prompt_size(body, body_bytes)  # None: it has images
        ask = True
        if fits_below > 0 and size is not None:
            bound = await self._chat_bound(body, size)
            if bound is not None and bound <= fits_below:
                return PromptCount(bound, "bound")
            # A probe just failed: asking again would only double the wait.
            ask = self.template_base is not None and (
                not body.get("tools") or self.tool_costs is not None)
        if ask and self._may_ask(refuse_when_busy):
            try:
                with self._asking():
                    return PromptCount(await self._ask_chat_like(route, body), "engine")
            except CountFailed as error:
                self._log_fallback(error)
        bound = self._known_bound(body, size)
        if bound is not None:
            return PromptCount(bound, "estimate")
        images, image_bytes = images_in(body)
        tools = body.get("tools")
        tool_bytes = len(compact_json(tools)) if tools else 0
        base = self.template_base if self.template_base is not None else TEMPLATE_ALLOWANCE
        estimate = (body_bytes - image_bytes + tool_bytes + images * IMAGE_TOKENS
                    + base + TEXT_SLACK)
        return PromptCount(estimate, "estimate")

    async def _ask_chat_like(self, route: str, body: Mapping[str, Any]) -> int:
        async with _deadline(self.timeout):
            try:
                return await self.tokenizer.count_input_tokens(route, body)
            except CountFailed as error:
                if not (error.missing and route == CHAT):
                    raise
            return await self.tokenizer.tokenize(await self.tokenizer.apply_template(body))

    async def _template_base(self) -> int | None:
        """Measured once per counter; concurrent first requests share one probe."""
        if self.template_base is not None:
            return self.template_base
        if self._calibrating is None:
            self._calibrating = asyncio.ensure_future(self._measure_template())
        return await asyncio.shield(self._calibrating)

    async def _measure_template(self) -> int | None:
        try:
            tokens = await self._ask_chat_like(CHAT, _PROBE)
        except CountFailed as error:
            self._log_fallback(error)
            self._calibrating = None  # try again with a later request
            return None
        # All of it, the probe message's own markers included: a safe upper bound of
        # the fixed part, whatever the split between fixed and per-message text.
        self.template_base = tokens
        return self.template_base

    async def _tool_costs(self) -> ToolCosts | None:
        """Measured once per counter, like the template's base."""
        if self.tool_costs is not None:
            return self.tool_costs
        if self._calibrating_tools is None:
            self._calibrating_tools = asyncio.ensure_future(self._measure_tools())
        return await asyncio.shield(self._calibrating_tools)

    async def _measure_tools(self) -> ToolCosts | None:
        """The probe conversation with no tool, one and two (the same tool's shape under
        two names): the second tool's tokens are what each tool costs beyond its JSON
        (its JSON's own tokens included: an upper bound), the first's beyond that is
        the fixed part (tool-use instructions)."""
        try:
            none = await self._ask_chat_like(CHAT, _PROBE)
            one = await self._ask_chat_like(CHAT, dict(_PROBE, tools=[_PROBE_TOOLS[0]]))
            two = await self._ask_chat_like(CHAT, dict(_PROBE, tools=_PROBE_TOOLS))
        except CountFailed as error:
            self._log_fallback(error)
            self._calibrating_tools = None
            return None
        per_tool = max(0, two - one)
        self.tool_costs = ToolCosts(fixed=max(0, one - none - per_tool), per_tool=per_tool)
        return self.tool_costs

    def _may_ask(self, refuse_when_busy: bool) -> bool:
        """Whether a count may be asked of the engine now; CountingFull when it may not
        and the caller waits for its count before admission."""
        if not self.busy:
            return True
        if refuse_when_busy:
            raise CountingFull(
                "The server is counting the prompts of as many requests as it takes at "
                "once. Try again shortly.", retry_after=BUSY_RETRY_AFTER)
        return False

    @contextlib.contextmanager
    def _asking(self) -> Iterator[None]:
        self.counting += 1
        try:
            yield
        finally:
            self.counting -= 1

    # --- completions and embeddings ---------------------------------------------------

    async def _count_prompts(self, prompt: Any, fits_below: int,
                             refuse_when_busy: bool) -> PromptCount:
        texts, exact = split_prompts(prompt)
        bound = exact + sum(len(t.encode()) + TEXT_SLACK for t in texts)
        if not texts:
            return PromptCount(exact, "exact")
        if 0 < fits_below and bound <= fits_below:
            return PromptCount(bound, "bound")
        if not self._may_ask(refuse_when_busy):
            return PromptCount(bound, "estimate")
        try:
            with self._asking():
                async with _deadline(self.timeout):
                    counted = [await self.tokenizer.tokenize(t) for t in texts]
            return PromptCount(exact + sum(counted), "engine")
        except CountFailed as error:
            self._log_fallback(error)
            return PromptCount(bound, "estimate")

    def _log_fallback(self, error: CountFailed) -> None:
        if self._logged_fallback:
            log.debug("prompt tokens estimated: %s", error)
            return
        self._logged_fallback = True
        log.warning("The engine could not count prompt tokens (%s); using a conservative "
                    "estimate from the request's size (logged once per load).", error)


def output_budget(route: str, body: Mapping[str, Any], *, prompt_tokens: int, limit: int,
                  cap: int = 0, default: int = DEFAULT_OUTPUT_TOKENS) -> int:
    """Output tokens to reserve for a request whose prompt is `prompt_tokens`.

    The request's one output limit (`backend.admission.output_limits.output_limit`: its own,
    read in the order the engine reads its fields, at most the operator's `cap` (0:
    none), which the gateway also writes into every limit field the engine reads), else
    `default`; then at most the room left in one request's share `limit` (llama-server
    stops a slot at its context end with finish reason "length", so a larger limit could
    never be used); never below MIN_OUTPUT_TOKENS, so a prompt too long for any reply
    does not fit.  Embeddings generate nothing: 0.
    """
    if route == EMBEDDINGS:
        return 0
    written = output_limit(route, body, cap)
    budget = written if written is not None else default
    return max(MIN_OUTPUT_TOKENS, min(budget, limit - prompt_tokens))


def token_need(route: str, body: Mapping[str, Any], prompt: PromptCount, *, limit: int,
               cap: int = 0, default: int = DEFAULT_OUTPUT_TOKENS) -> TokenNeed:
    """The admission need: counted prompt plus its output budget."""
    return TokenNeed(prompt.tokens, output_budget(route, body, prompt_tokens=prompt.tokens,
                                                  limit=limit, cap=cap, default=default))


# --- helpers -----------------------------------------------------------------------------


class _deadline:
    """asyncio.timeout that turns its TimeoutError into CountFailed."""

    def __init__(self, seconds: float) -> None:
        self._timeout = asyncio.timeout(seconds if seconds > 0 else None)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, kind: Any, error: Any, tb: Any) -> None:
        try:
            await self._timeout.__aexit__(kind, error, tb)
        except TimeoutError:
            raise CountFailed("the engine did not answer in time") from None
