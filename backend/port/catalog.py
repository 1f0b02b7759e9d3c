"""What the port tells clients about the models it serves (`/v1/models`, `/health`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelCard"]


@dataclass(frozen=True)
class ModelCard:
    """One model as clients see it; `details` is for /health (no paths, keys or ports)."""

    id: str
    state: str  #: "ready", "loading", "unloaded", "evicted", "failed", ...
    context_length: int | None  #: what one request may use (prompt + output), when known
    max_output_tokens: int | None
    default: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def to_model(self, created: int) -> dict[str, Any]:
        """The `/v1/models` entry."""
        return {"id": self.id, "object": "model", "created": created, "owned_by": "gguf-studio",
                "context_length": self.context_length, "max_output_tokens": self.max_output_tokens,
                "state": self.state}
