"""One engine as its line reads and books it (`LineEngine`: `AdmissionQueue`, in
`backend.admission.engine_queue`): its slots and cache as placement reads them
(`seat.SeatEngine`), and the tickets it takes and gives back
(`backend.admission.line`)."""

from __future__ import annotations

from typing import Protocol, Self

from backend.admission.admission_ticket import Ticket
from backend.admission.seat import Seat, SeatEngine

__all__ = ["LineEngine"]


class LineEngine(SeatEngine, Protocol):
    """One engine as its line reads and books it (`AdmissionQueue`)."""

    @property
    def capacity(self) -> int: ...

    @property
    def active(self) -> int: ...

    @property
    def enabled(self) -> bool:
        """Admission on: off, everyone goes in at once (and is still counted)."""

    @property
    def counts_prompts(self) -> bool:
        """It answers llama-server's prompt-counting routes (the need planner asks it)."""

    def take(self, ticket: Ticket, now: float, seat: Seat[Self] | None = None) -> None:
        """Admit `ticket` on `seat` (a free slot of this engine)."""

    def give_back(self, ticket: Ticket) -> None:
        """`ticket` ended or went back in line: its slot and tokens are free."""

    def give_back_tokens(self, tokens: int) -> None:
        """A running ticket settled below what it reserved."""
