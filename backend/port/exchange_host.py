"""What an exchange (`backend.port.relay`) needs from the port that serves it
(`ExchangeHost`: its upstream client, its planner, its books, its keys' checks, its
resends) and from the steward of parked prefixes (`PrefixSteward`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from backend.admission.caller import Caller
from backend.port.settlement import SettlementHost

if TYPE_CHECKING:
    from backend.admission.admission_ticket import Ticket
    from backend.admission.request_planner import RequestPlanner
    from backend.port.resends import Resends
    from backend.port.upstream_http import UpstreamClient

__all__ = ["ExchangeHost", "PrefixSteward"]


class ExchangeHost(SettlementHost, Protocol):
    """What an exchange needs from the port that serves it (and where its books are kept)."""

    @property
    def client(self) -> UpstreamClient: ...

    @property
    def closing(self) -> bool: ...

    @property
    def planner(self) -> RequestPlanner:
        """Plans a request that waited for its model's load, as it admitted the others."""

    def recheck(self, caller: Caller) -> None:
        """Raise the refusal of the caller's key as it is now (revoked, expired, gone)."""

    @property
    def parking(self) -> PrefixSteward | None:
        """Who restores a session's parked prefix into its seat (None: nobody)."""

    @property
    def resends(self) -> Resends | None:
        """Where a request whose client left waits for its resend (None: it does not)."""


class PrefixSteward(Protocol):
    """What the relay asks of the steward of parked prefixes
    (`backend.app.pool.parking_steward`; the slot files it keeps are
    `backend.llama.slot_parking`'s): between the seat and the request, and once the
    answer's last bytes are in."""

    async def before_send(self, ticket: Ticket, model: str | None,
                          body: bytes = b"") -> object | None: ...

    def after_answer(self, pending: object | None, tail: bytes) -> None: ...

    def remember(self, ticket: Ticket, model: str | None, path: str, body: bytes) -> None: ...
