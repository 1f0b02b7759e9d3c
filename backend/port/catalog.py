"""What the port tells clients about the models it serves (`/v1/models`, `/health`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from backend.models.model_names import DEFAULT_MODEL_ALIAS

__all__ = ["ModelCard", "model_list"]


def model_list(cards: Sequence[ModelCard], created: int) -> list[dict[str, Any]]:
    """The `/v1/models` entries: every model, then the default model once more under
    `default` (`DEFAULT_MODEL_ALIAS`, with `alias_of` naming it), a name that stays the
    same when the owner loads another model, so agents configured with it keep working.
    Not when a model is given that name itself: the name is that model's."""
    data = [card.to_model(created) for card in cards]
    default = next((card for card in cards if card.default), None)
    taken = any(name.casefold() == DEFAULT_MODEL_ALIAS
                for card in cards for name in (card.id, *card.details.get("aliases", ())))
    if default is not None and not taken:
        data.append(dict(default.to_model(created), id=DEFAULT_MODEL_ALIAS, alias_of=default.id))
    return data


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
