"""Capacity in KV tokens: the engine's cache, and what one request needs of it.

Plain values, read by `backend.admission` to decide and by the metrics and the window
to show; `backend.prompt_tokens` makes the needs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KvCapacity", "TokenNeed"]


@dataclass(frozen=True, slots=True)
class KvCapacity:
    """The engine's KV cache, in tokens, as read after a healthy load."""

    total: int        #: every slot's tokens together (llama-server's n_ctx)
    per_request: int  #: the most one request may hold (llama-server's n_ctx_slot)
    unified: bool     #: one pool shared by all slots, else a fixed share per slot

    def __post_init__(self) -> None:
        if not (_whole(self.total) and self.total >= 1):
            raise ValueError(f"KV capacity must be at least 1 token, not {self.total!r}")
        if not (_whole(self.per_request) and 1 <= self.per_request <= self.total):
            raise ValueError(f"the per-request limit must be 1..{self.total} tokens, "
                             f"not {self.per_request!r}")

    @classmethod
    def split(cls, total: int, slots: int) -> KvCapacity:
        """A cache cut into `slots` equal shares (llama-server without --kv-unified)."""
        return cls(total, max(1, total // slots), unified=False)

    @classmethod
    def shared(cls, total: int, per_request: int | None = None) -> KvCapacity:
        """One pool (--kv-unified), optionally capped per request (--kv-unified-per-slot)."""
        return cls(total, total if per_request is None else per_request, unified=True)


@dataclass(frozen=True, slots=True)
class TokenNeed:
    """What one request may hold in the KV cache: its prompt plus its output budget."""

    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


def _whole(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)
