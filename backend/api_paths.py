"""The paths of the API, in one place: the OpenAI-compatible routes (and Anthropic's
Messages) that the port serves and sends on to the same path of an engine, the port's own
routes, and llama-server's routes for counting a prompt.

Admission counts and bounds a request by its route, the port serves and routes it, the
app and a teammate's `connect` ask the port by it, and the engine's client restores a
slot for it: all of them import the path from here.  The endpoints of llama-server's own
that only its client calls (`/props`, `/slots`, `/tokenize`, `/completion`) stay with that
client (`backend.llama.api`, `backend.llama.slot_parking`).
"""

from __future__ import annotations

__all__ = ["CHAT", "COMPLETIONS", "COUNT_ROUTES", "EMBEDDINGS", "ENROLMENTS", "HEALTH",
           "MESSAGES", "METRICS", "MODELS", "REQUESTS", "RESPONSES"]

# --- the API's routes: the port serves them, an engine answers them ------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
#: Anthropic's Messages API (Claude Code), which llama-server converts to a chat.
MESSAGES = "/v1/messages"
EMBEDDINGS = "/v1/embeddings"
MODELS = "/v1/models"
HEALTH = "/health"
METRICS = "/metrics"

# --- the port's own ----------------------------------------------------------------------

#: The request inspector's records (`backend.port.request_log`).
REQUESTS = "/requests"
#: A teammate without a key asks for one here (`backend.port.enrolment_endpoint`); its
#: request is then polled at `ENROLMENTS/{token}`.
ENROLMENTS = "/v1/enrolments"

# --- llama-server's -------------------------------------------------------------------------

#: Route -> llama-server's counting route for it.
COUNT_ROUTES = {
    CHAT: "/v1/chat/completions/input_tokens",
    RESPONSES: "/v1/responses/input_tokens",
    MESSAGES: "/v1/messages/count_tokens",
}
