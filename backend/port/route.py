"""Where the requests for one model go: the app's one answer to the gateway's question."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backend.admission.flow import Band
from backend.api_paths import CHAT, MESSAGES, RESPONSES

__all__ = ["CHAT_ROUTES", "Route"]

#: The routes whose requests are chats the engine renders with the model's chat template
#: (a model without one takes none of them: backend.errors.NoChatTemplate).
CHAT_ROUTES = frozenset({CHAT, RESPONSES, MESSAGES})


def _served_already(band: Band) -> None:
    """The model is served: nothing to start."""


@dataclass(frozen=True, slots=True)
class Route:
    """The model a request is for, and how it is sent there.

    Asking for it has no side effect (a request refused for its key's limits after it
    loads and evicts nothing); `serve` then makes sure the model will be served."""

    #: The model's name: what the request is counted and admitted under, and what it is
    #: sent naming, never the client's spelling.
    model: str
    #: Its engines are another port serving several models, which would take a request
    #: naming none for its own default model: the request must be sent naming `model`.
    named: bool = False
    #: It shares no prompt cache between requests (sent with `cache_prompt: false`).
    isolated: bool = False
    #: Make sure the model will be served, for a request of this priority band (which
    #: decides what its load may evict): may start loading it; ModelNotReady when it
    #: cannot be now (a failed model in its cool-down).
    serve: Callable[[Band], None] = _served_already
