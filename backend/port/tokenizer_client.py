"""The engine's tokenizer over llama-server's HTTP routes: the `EngineTokenizer` that
`backend.admission.prompt_tokens.PromptCounter` asks (the gateway hands admission's
`RequestPlanner` a factory that makes one per engine load; the counting rules do no I/O of
their own).

Its routes: llama-server's counting routes for chat completions, Responses and Anthropic
messages (`COUNT_ROUTES`), `/apply-template` and `/tokenize`.  Every failure (no
connection, an HTTP error, an answer without its field) is a `CountFailed`; a route the
engine does not have (404, 405, 501: an older attached engine) says so (`missing`), and
the counter then asks `/apply-template` and `/tokenize` instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from backend.llama.api import engine_headers
from backend.admission.prompt_tokens import CountFailed
from backend.api_paths import COUNT_ROUTES
from backend.port.upstream_errors import UpstreamError
from backend.port.upstream_http import UpstreamClient

__all__ = ["HttpEngineTokenizer"]


class HttpEngineTokenizer:
    """EngineTokenizer over llama-server's HTTP routes at `base_url`."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 headers: Mapping[str, str] | None = None,
                 client: UpstreamClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Content-Type": "application/json", **engine_headers(api_key),
                         **(headers or {})}
        self._client = client or UpstreamClient(connect_timeout=5.0, max_idle=8)
        self._owns_client = client is None

    async def count_input_tokens(self, route: str, body: Mapping[str, Any]) -> int:
        answer = await self._post(COUNT_ROUTES[route], body)
        tokens = answer.get("input_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise CountFailed("the engine's count had no input_tokens")
        return tokens

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        prompt = (await self._post("/apply-template", body)).get("prompt")
        if not isinstance(prompt, str):
            raise CountFailed("the engine's template answer had no prompt")
        return prompt

    async def tokenize(self, text: str) -> int:
        answer = await self._post("/tokenize", {"content": text, "add_special": True,
                                                "parse_special": True})
        tokens = answer.get("tokens")
        if not isinstance(tokens, list):
            raise CountFailed("the engine's tokenize answer had no tokens")
        return len(tokens)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        request = self._client.build_request("POST", self.base_url + path,
                                             content=_compact(body).encode(),
                                             headers=self._headers)
        try:
            response = await self._client.send(request)
            try:
                raw = await response.aread()
            finally:
                await response.aclose()
        except (UpstreamError, OSError) as error:
            raise CountFailed(f"{path}: {type(error).__name__}") from None
        if response.status_code in (404, 405, 501):
            raise CountFailed(f"{path}: HTTP {response.status_code}", missing=True)
        if response.status_code != 200:
            raise CountFailed(f"{path}: HTTP {response.status_code}")
        try:
            answer = json.loads(raw)
        except ValueError:
            raise CountFailed(f"{path}: not JSON") from None
        if not isinstance(answer, dict):
            raise CountFailed(f"{path}: not a JSON object")
        return answer


# --- helpers -----------------------------------------------------------------------------


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
