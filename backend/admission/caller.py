"""Who sent a request, as admission counts it: a flow, and its key's limits."""

from __future__ import annotations

from dataclasses import dataclass

from backend.keys.key_store import KeyRecord

__all__ = ["ADDRESS_FLOW", "ANONYMOUS", "Caller"]


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the flow it counts against (a key's name, or the client's
    address when no named keys exist), and its key's limits (None: no key at all)."""

    flow: str
    key: KeyRecord | None = None

    @property
    def name(self) -> str:
        """For usage and metrics: the key's name, or "anonymous" (never an address)."""
        return self.key.name if self.key is not None else "anonymous"


#: Without named keys each client address is one flow, called this + the address.
ADDRESS_FLOW = "address "
#: The caller of a request no key or address is known for.
ANONYMOUS = Caller("")
