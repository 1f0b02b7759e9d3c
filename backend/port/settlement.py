"""A request's books, closed once when it ends: what it cost and what it did.

What it cost: a request ends booked in its key's limiter and usage (`Settlement.close`):
with the engine's usage when the answer carried it, else (the client left mid-stream, the
key was revoked, the engine broke off) with the prompt admission counted plus one token
per event relayed; a non-streamed answer that was never read costs its reservation.  Its
session book is told once how its turn ended (`Sessions.turn_ended`: where the answer left
its session's prefix, and its prompt's cached and computed tokens, judged), and the verdict
it gives back is counted with why a miss missed (`Metrics.count_prompt`).

What it did: each request leaves one record in the request inspector's ring
(`backend.port.request_log`): its wait and why (its ticket's `wait_reason`), the engine's
figures read once from the answer's last bytes, its time to first token and the longest
silence between chunks, never content.

The exchange (`backend.port.relay`) keeps the per-chunk counts itself and hands them over
as an `Ending` once, after its ticket is released: nothing here runs per chunk.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from backend.admission.admission_ticket import Ticket, WaitReason
from backend.admission.seat import keeps_slots
from backend.port import sse
from backend.port.metrics import UNROUTED
from backend.port.request_log import NO_FIGURES, RequestLog, figures_in

if TYPE_CHECKING:
    from backend.admission.cache_misses import Verdict
    from backend.admission.prompt import PromptBlocks
    from backend.admission.engine_queue import AdmissionQueue
    from backend.admission.flow import Band
    from backend.admission.flow_control import Pass
    from backend.admission.line import Line
    from backend.admission.hint import Hint
    from backend.admission.session_book import Sessions
    from backend.errors import RequestError
    from backend.port.metrics import Metrics
    from backend.port.prefill import PrefillProgress
    from backend.port.request_body import Parsed
    from backend.settings import Settings

__all__ = ["Ending", "Settlement", "SettlementHost", "SettledRequest"]


class SettlementHost(Protocol):
    """Where a request's books are kept: the port that served it."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def requests(self) -> RequestLog:
        """The request inspector's ring, where each exchange leaves its record."""

    @property
    def sessions(self) -> Sessions:
        """The session book (`backend.admission.session_book`), told once as a turn ends."""


class SettledRequest(Protocol):
    """What the books read of the request as it was checked (`gated_request.GatedRequest`)."""

    @property
    def path(self) -> str: ...

    @property
    def parsed(self) -> Parsed: ...

    @property
    def model_id(self) -> str | None: ...

    @property
    def passage(self) -> Pass: ...

    @property
    def body_bytes(self) -> int: ...

    @property
    def band(self) -> Band | None: ...

    @property
    def hint(self) -> Hint: ...

    @property
    def traceparent(self) -> str | None: ...

    @property
    def blocks(self) -> PromptBlocks: ...


class Ending(NamedTuple):
    """How a request ended, as its exchange saw it (all times `time.monotonic`).  A tuple,
    built in one step (see `gated_request.GatedRequest`)."""

    ticket: Ticket | None
    #: The error the request ended with, if it did.
    failed: RequestError | None
    #: Events relayed from the engine: about one generated token each.
    events: int
    #: Set once the engine's whole answer was relayed.
    answered: bool
    #: The last bytes relayed, where the engine's `usage` is; an Anthropic stream's
    #: `message_start` (the one event that names its prompt) before them.
    tail: bytes
    #: When it arrived, and its wait for its model to load.
    arrived: float
    loading: float
    #: The engine's first bytes, the last chunk's arrival, the longest silence between two.
    first_at: float | None
    last_at: float
    longest_gap: float
    #: The client went away before its answer was complete.
    client_gone: bool
    #: The status its client got (an error after the stream began leaves 200).
    status: int
    #: How far the engine had read its prompt, if it said (`backend.port.prefill`).
    progress: PrefillProgress | None = None
    #: What its resend joined, if one did (`backend.port.resends`).
    joined: str | None = None


class Settlement:
    """One request's books: `close()` settles its flow, tells the session book how its
    turn ended, counts the verdict on its prompt's cache and leaves its record."""

    def __init__(self, host: SettlementHost, line: Line[AdmissionQueue],
                 request: SettledRequest, ending: Ending) -> None:
        self.host = host
        self.line = line
        self.request = request
        self.ending = ending
        self.passage = request.passage
        self.ticket = ending.ticket
        #: The figures the answer's last bytes carry (`sse.final_payloads`), parsed once
        #: (`_final_payloads`) for its books, its session and its record.
        self._payloads: list[dict[str, Any]] | None = None

    def close(self) -> None:
        prompt = self._account()
        # Judged before the record, which names a miss's reason: a comparison of block
        # hashes made at the gateway (tens of microseconds for an agent's turn).
        verdict = self._tell_book(prompt)
        self._record(verdict)

    def _account(self) -> tuple[int, int] | None:
        """Tell the caller's flow how it ended: the engine's usage settles its token
        reservation; an answer without it (cut short) is charged what it got
        (`_cut_usage`), as is the part the usage does not say; a refusal or an error
        before anything was relayed gives the reservation back.  What its session's
        prefix now holds: (prompt tokens, of them found cached), from the answer's
        figures (its final `timings`; its usage's prompt alone without them); None when
        the engine holds nothing of it."""
        ending = self.ending
        if ending.failed is not None and not ending.events:
            self.passage.refused(ending.failed)
        elif ending.answered or (self.ticket is not None and self.ticket.admitted_at is not None):
            payloads = self._final_payloads()
            told_prompt, told_completion = sse.usage_in(payloads) or (None, None)
            prompt, completion = self._cut_usage()
            self.passage.answered((prompt if told_prompt is None else told_prompt,
                                   completion if told_completion is None else told_completion))
            if ending.answered:
                figures = _prompt_figures(payloads)
                return figures if figures is not None or told_prompt is None \
                    else (told_prompt, 0)
            if ending.events:
                # Stopped mid-answer: its slot holds the prompt all the same, and the
                # conversation's next turn (a stop, then a new question) belongs there.
                return prompt, 0
        else:
            self.passage.left()  # before its turn
        return None

    def _record(self, verdict: Verdict | None = None) -> None:
        """Leave this request's record in the inspector's ring: names, times and the
        engine's figures, read once from the answer's last bytes; nothing of its content."""
        ending = self.ending
        ticket = self.ticket
        request = self.request
        seat = ticket.seat if ticket is not None else None
        figures = figures_in(self._final_payloads()) \
            if ending.events or ending.answered else NO_FIGURES
        wait, reason, behind = self._waited()
        first = ending.first_at
        session = request.hint.session
        error = ending.failed
        output = figures.output_tokens
        if (seat is not None and figures.prefill_ms and figures.prompt_tokens is not None
                and figures.cached_tokens is not None):
            # An engine not measured after its load (an attached llama-server) is timed
            # by its answers: placement bounds a session's wait for it by that pace.
            seat.engine.observe_prefill(figures.prompt_tokens - figures.cached_tokens,
                                        figures.prefill_ms / 1e3)
        self.host.requests.add(
            traceparent=request.traceparent,
            time=time.time() - (time.monotonic() - ending.arrived),
            route=request.path, key=self.passage.caller.name,
            session=None if session is None else session.split("\n", 1)[-1],
            model=request.model_id,
            engine=seat.engine.label if seat is not None else None,
            slot=seat.slot if seat is not None else None,
            band=self._band_name(), stream=request.parsed.stream,
            wait=wait, wait_reason=reason, waited_behind=behind,
            prompt_tokens=figures.prompt_tokens, cached_tokens=figures.cached_tokens,
            computed_tokens=(None if figures.prompt_tokens is None or figures.cached_tokens is None
                             else figures.prompt_tokens - figures.cached_tokens),
            cache_miss=None if verdict is None or not verdict.missed else verdict.describe(),
            output_tokens=output if output is not None or not ending.events else ending.events,
            prefill_ms=figures.prefill_ms,
            time_to_first_token=None if first is None else first - ending.arrived,
            tokens_per_second=figures.tokens_per_second,
            longest_gap=ending.longest_gap if first is not None and ending.last_at > first else None,
            status=499 if ending.client_gone else ending.status,
            error=None if error is None else error.code, joined=ending.joined,
            prefilled=(ending.progress.processed if ending.progress is not None and first is None
                       else None))

    def _waited(self) -> tuple[float, str | None, str | None]:
        """(seconds, reason, the key it waited behind) from arrival until it ran: its
        ticket's wait as admission tells it, or its model's load when that was longer."""
        ticket = self.ticket
        loading = self.ending.loading
        queued = 0.0
        reason = behind = None
        if ticket is not None:
            ran_at = ticket.admitted_at if ticket.admitted_at is not None else time.monotonic()
            queued = max(0.0, ran_at - ticket.enqueued_at)
            reason, behind = ticket.wait_reason, ticket.waited_behind
        if loading > queued:
            reason, behind = WaitReason.MODEL_LOADING, None
        return loading + queued, reason, behind

    def _band_name(self) -> str | None:
        ticket = self.ticket
        band = self.request.band
        if ticket is not None:
            flow_band = ticket.flow.band
            band = flow_band if ticket.band is None else max(ticket.band, flow_band)
        return None if band is None else band.name.lower()

    def _final_payloads(self) -> list[dict[str, Any]]:
        """The answer's figures, parsed from its last bytes the first time they are asked
        for (an Anthropic stream names its prompt in its first event only)."""
        if self._payloads is None:
            self._payloads = sse.final_payloads(self.ending.tail)
        return self._payloads

    def _tell_book(self, prompt: tuple[int, int] | None) -> Verdict | None:
        """Tell the session book how the turn ended, once (`Sessions.turn_ended`): where
        the answer left its session's prefix (`prompt`: its tokens and those the engine's
        cache held, from `_account`), and for an answer, its cached and computed prompt
        tokens (from the engine's last figures), judged against the turn it continues;
        then the line's placement hears what the book learnt (`Placement.learned`).  The
        verdict is counted by kind and reason (`Metrics.count_prompt`) and returned."""
        ticket = self.ticket
        if ticket is None or ticket.engine is None:
            return None
        cache = sse.prompt_cache_in(self._final_payloads()) if self.ending.answered else None
        seat = ticket.seat
        if seat is None:
            prompt = None  # it was placed nowhere
        if cache is None and prompt is None:
            return None
        hint = self.request.hint
        engines = self.line.engines
        model = self.request.model_id or UNROUTED
        verdict = self.host.sessions.turn_ended(
            hint.session, self.passage.caller.flow, model=model, prefix=hint.prefix,
            blocks=self.request.blocks, engine=ticket.serving.key, label=ticket.engine.label,
            slot=None if seat is None else seat.slot, pinned=seat is not None and seat.pinned,
            keeps_slot=seat is not None and keeps_slots(seat.engine), prompt=prompt,
            cache=cache, engine_alive=lambda key: any(e.key == key for e in engines))
        if hint.session is not None and prompt is not None:
            self.line.placement.learned(ticket, self.host.sessions.where(hint.session))
        if verdict is not None:
            self.host.metrics.count_prompt(model, verdict)
        return verdict

    def _cut_usage(self) -> tuple[int, int]:
        """(prompt, completion) tokens of an answer that ended before the engine's usage
        reached the client: the prompt as admission counted it (its byte bound when it
        was not counted), and for a stream one token per event relayed (llama-server
        sends one event per token, plus a few around them: this is at least what the
        client got); a non-streamed answer, of which nothing can be counted, costs its
        whole output budget, as reserved."""
        ticket = self.ticket
        need = ticket.need if ticket is not None else None
        if need is not None:
            prompt, output = need.prompt, need.output
        else:
            prompt, output = self.request.body_bytes, self.host.settings.default_output_tokens
        return prompt, (self.ending.events if self.request.parsed.stream else output)


def _prompt_figures(payloads: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(prompt, cached) tokens from the last `timings` an answer carries (llama-server's
    final chunk or body: `prompt_n` computed, `cache_n` found in its cache); None when
    it carries none."""
    for payload in payloads:
        timings = payload.get("timings")
        if isinstance(timings, dict):
            computed, cached = timings.get("prompt_n"), timings.get("cache_n")
            if isinstance(computed, int) and isinstance(cached, int):
                return max(0, computed) + max(0, cached), max(0, cached)
    return None
