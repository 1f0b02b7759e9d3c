"""A checked request for a gated route, before it has a ticket (`GatedRequest`): what the
gateway read, resolved and planned of it, handed to its exchange (`backend.port.relay`)
and, as it ends, to its books (`backend.port.settlement`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, NamedTuple, Sequence

from backend.admission.prompt import NO_BLOCKS, PromptBlocks
from backend.admission.flow import Band
from backend.admission.flow_control import Pass
from backend.admission.hint import NO_HINT, Hint
from backend.admission.need_planner import NO_PLAN, Plan
from backend.port import sse

if TYPE_CHECKING:
    from backend.port.request_body import Parsed

__all__ = ["GatedRequest"]


class GatedRequest(NamedTuple):
    """A checked request for a gated route, before it has a ticket.  A tuple: made for
    every request, it is built in one step (a frozen dataclass sets each field through
    `object.__setattr__`, about 70 bytecode instructions more a request)."""

    path: str
    kind: sse.StreamKind
    parsed: Parsed
    model_id: str | None
    #: Its way through its caller's limits (who sent it, its flow, its key's windows).
    passage: Pass
    #: What it will hold of the engine's cache, and whether it is counted while it runs;
    #: None while no engine serves its model yet (it is loading): planned once one does.
    plan: Plan | None = NO_PLAN
    #: The body's size as received, for planning later.
    body_bytes: int = 0
    #: The priority band it asked for (only ever lower than its key's).
    band: Band | None = None
    #: Its wait for its model to load (`Line.when_served`), when it was loading.
    served: asyncio.Future[None] | None = None
    #: Its session and prompt prefix, for placement (planned with it once it can be).
    hint: Hint = NO_HINT
    #: When it arrived (`time.monotonic`), for its waits and its time to first token.
    arrived: float = 0.0
    #: The client's W3C `traceparent`, read only while spans are exported.
    traceparent: str | None = None
    #: Its prompt's blocks, to say why its answer's prompt missed the cache (if it did).
    blocks: PromptBlocks = NO_BLOCKS
    #: Its headers as received (the session headers tell its twin: `backend.port.resends`).
    headers: Sequence[tuple[bytes, bytes]] = ()
