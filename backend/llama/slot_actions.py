"""llama-server's slot actions over its HTTP API (`SlotClient`): how many tokens a slot
holds, save a slot to a file and restore one, erase or vacate a slot (its prompt moved to
the engine's RAM prompt cache), and recall a prompt from that cache into a slot by
sending its request again for one token (`recall_body`).  What to save, where, and when
a restore took is the parking lot's (`backend.llama.slot_parking`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from backend.api_paths import MESSAGES
from backend.llama.api import engine_headers

__all__ = ["SAVE_TIMEOUT", "Saved", "SlotActionFailed", "SlotClient", "recall_body"]

#: Seconds one save or restore may take before it is given up (the engine defers a
#: slot action while the slot works, so a busy slot would otherwise hold it for ever).
SAVE_TIMEOUT = 10.0


@dataclass(frozen=True)
class Saved:
    """What the engine said of a save."""

    tokens: int
    bytes: int
    #: The context checkpoints it kept with them; None: it does not say (it keeps none).
    checkpoints: int | None


class SlotActionFailed(Exception):
    """The engine refused or did not finish a slot save or restore (its words kept for
    the log, never shown to a client)."""


class SlotClient:
    """llama-server's slot actions at `base_url` (its own port and key)."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 timeout: float = SAVE_TIMEOUT) -> None:
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout, trust_env=False,
                                         headers=engine_headers(api_key))

    async def __aenter__(self) -> "SlotClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def slot_tokens(self, slot: int) -> int:
        """Tokens `slot` holds, which a save writes (llama-server's `/slots`); a slot that
        does not say (it ran no task yet) is counted as full: its context."""
        try:
            response = await self._client.get("/slots")
        except httpx.HTTPError as exc:
            raise SlotActionFailed(f"listing the slots got no answer ({type(exc).__name__})") from None
        try:
            slots = response.json()
        except ValueError:
            slots = None
        if response.status_code != 200 or not isinstance(slots, list):
            raise SlotActionFailed(f"listing the slots answered {response.status_code}")
        for entry in slots:
            if isinstance(entry, dict) and entry.get("id") == slot:
                held = entry.get("n_prompt_tokens")
                return _count(held) if isinstance(held, int) else _count(entry.get("n_ctx"))
        raise SlotActionFailed(f"the engine lists no slot {slot}")

    async def save(self, slot: int, filename: str) -> Saved:
        """What `slot` wrote to `filename` in the engine's slot directory."""
        body = await self._action(slot, "save", filename)
        return Saved(_count(body.get("n_saved")), _count(body.get("n_written")),
                     _checkpoints(body))

    async def restore(self, slot: int, filename: str) -> tuple[int, int | None]:
        """Tokens read back into `slot`, and its context checkpoints (None: the engine
        does not say)."""
        body = await self._action(slot, "restore", filename)
        return _count(body.get("n_restored")), _checkpoints(body)

    async def parks_checkpoints(self, slot: int, filename: str) -> bool:
        """Does the engine keep a slot's context checkpoints in its save file?  Asked by
        saving `slot`, empty (as after a start), to `filename`, which the caller
        removes: the answer says how many it kept, or says nothing of them."""
        return _checkpoints(await self._action(slot, "save", filename)) is not None

    async def erase(self, slot: int) -> None:
        await self._action(slot, "erase", None)

    async def vacate(self, slot: int) -> None:
        """Move what `slot` holds to the engine's RAM prompt cache (a restore overwrites a
        slot and would lose it): a pinned request of one token does, on an engine whose
        slot similarity is not 0 (`get_available_slot` saves a slot's prompt before it
        loads another)."""
        await self._post("vacating a slot", "/completion", json={
            "prompt": " ", "n_predict": 1, "id_slot": slot, "cache_prompt": True})

    async def recall(self, slot: int, path: str, body: bytes) -> tuple[int, int]:
        """Send `body`, a request the engine answered before (on `path`, made to compute
        its prompt and one token in `slot`: `recall_body`), so that what its RAM prompt
        cache holds of that prompt comes back into the slot; (prompt tokens taken from a
        cache, computed)."""
        try:
            content = recall_body(body, slot, anthropic=path == MESSAGES)
        except ValueError:
            raise SlotActionFailed("a recall's request is not one JSON object") from None
        answer = await self._post("a recall", path, content=content,
                                  headers={"content-type": "application/json"})
        timings = answer.get("timings")
        if isinstance(timings, dict):
            return _count(timings.get("cache_n")), _count(timings.get("prompt_n"))
        usage = answer.get("usage")  # an Anthropic answer has no timings
        if isinstance(usage, dict):
            return _count(usage.get("cache_read_input_tokens")), _count(usage.get("input_tokens"))
        return 0, 0

    async def _action(self, slot: int, action: str, filename: str | None) -> dict[str, Any]:
        return await self._post(f"slot {action}", f"/slots/{slot}", params={"action": action},
                                json={"filename": filename} if filename else {})

    async def _post(self, what: str, path: str, **request: Any) -> dict[str, Any]:
        """The engine's answer to one POST to `path`, a JSON object; SlotActionFailed,
        saying `what` was asked, when it gives none or not with 200."""
        try:
            response = await self._client.post(path, **request)
        except httpx.HTTPError as exc:
            raise SlotActionFailed(f"{what} got no answer ({type(exc).__name__})") from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code != 200 or not isinstance(body, dict):
            said = body.get("error", {}).get("message") if isinstance(body, dict) else None
            raise SlotActionFailed(f"{what} answered {response.status_code}: "
                                   f"{said or 'no reason given'}")
        return body


def recall_body(body: bytes, slot: int, *, anthropic: bool = False) -> bytes:
    """`body` (one JSON object, as the engine answered it before) made to compute its
    prompt and one token in `slot`, answered at once: pinned (`id_slot`), one token
    (`n_predict` outranks the route's own limit), not streamed, its prompt cached.  An
    Anthropic request keeps only the fields its conversion reads: one token is its
    `max_tokens`, and the pin is lost (the engine takes its least recently used slot)."""
    request = json.loads(body)
    if not isinstance(request, dict):
        raise ValueError("not a JSON object")
    request.pop("stream_options", None)
    request.update(id_slot=slot, n_predict=1, stream=False, cache_prompt=True)
    if anthropic:
        request["max_tokens"] = 1
    return json.dumps(request).encode()


# --- helpers ----------------------------------------------------------------------------


def _checkpoints(answer: dict[str, Any]) -> int | None:
    """How many context checkpoints a save or restore answer says it kept; None when it
    says nothing of them (an engine without our patch)."""
    value = answer.get("n_checkpoints")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
