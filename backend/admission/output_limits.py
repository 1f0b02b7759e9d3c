"""The output limit of a request, read as its engine reads it.

The routes the port serves, the limit fields each route's engine obeys (in the order the
pinned llama-server reads them), and the one limit a request ends with: its own, held to
the operator's cap.  `request_body` writes that limit into the body; the counting rules
(`prompt_tokens`) reserve it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backend.api_paths import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, RESPONSES

__all__ = ["CLIENT_LIMIT", "ENGINE_LIMITS", "MESSAGES_MAX_TOKENS", "output_limit",
           "requested_output"]

#: Route -> the output-limit fields its engine reads, in the order the pinned llama-server
#: reads them: the first one given (not null) is obeyed, the others ignored
#: (tools/server/server-schema.cpp: `n_predict`, aliased by `max_completion_tokens`, then
#: `max_tokens`).  A Responses request becomes a chat one whose `max_tokens` is its
#: `max_output_tokens` whenever that is present, null included (server-chat.cpp); an
#: Anthropic one keeps its `max_tokens` alone.  Embeddings generate nothing.
ENGINE_LIMITS: dict[str, tuple[str, ...]] = {
    CHAT: ("n_predict", "max_completion_tokens", "max_tokens"),
    COMPLETIONS: ("n_predict", "max_completion_tokens", "max_tokens"),
    RESPONSES: ("n_predict", "max_completion_tokens", "max_output_tokens", "max_tokens"),
    MESSAGES: ("max_tokens",),
    EMBEDDINGS: (),
}
#: Route -> the field its clients give a limit in: written when a request gives none.
CLIENT_LIMIT = {CHAT: "max_tokens", COMPLETIONS: "max_tokens", RESPONSES: "max_output_tokens",
                 MESSAGES: "max_tokens"}
#: A Responses request's limit fields when it gives `max_output_tokens`, which replaces its
#: `max_tokens` (read on each request: the check is made once, not per field).
_RESPONSES_GIVEN = tuple(name for name in ENGINE_LIMITS[RESPONSES] if name != "max_tokens")
#: What llama-server's Anthropic conversion gives a message that sets no `max_tokens`.
MESSAGES_MAX_TOKENS = 4096

def requested_output(route: str, body: Mapping[str, Any]) -> int | None:
    """The output limit `body` sets for `route`, read as its engine reads it: the first
    of `ENGINE_LIMITS` given; None for none, or for `n_predict: -1` (the engine's own
    default then, which is the operator's cap: `--n-predict`).  An Anthropic message
    without `max_tokens` gets the engine's `MESSAGES_MAX_TOKENS`."""
    names = ENGINE_LIMITS.get(route, ())
    if route == RESPONSES and "max_output_tokens" in body:
        names = _RESPONSES_GIVEN  # its `max_tokens` is replaced, even by a null one
    for name in names:
        value = body.get(name)
        if value is not None:
            return None if value == -1 else int(value)
    return MESSAGES_MAX_TOKENS if route == MESSAGES else None


def output_limit(route: str, body: Mapping[str, Any], cap: int) -> int | None:
    """The one output limit of a request: its own (`requested_output`), at most the
    operator's `cap` (0: none), the cap when it sets none; None when neither sets one
    (the engine then stops at its context's end, and admission reserves the default
    budget).  Embeddings generate nothing: None."""
    if route not in CLIENT_LIMIT:
        return None
    requested = requested_output(route, body)
    if cap <= 0:
        return requested
    return cap if requested is None else min(requested, cap)
