"""What the tests that start a real service share (the fixtures are in conftest.py)."""

from __future__ import annotations

from typing import Awaitable, Callable

import httpx

from backend.app.service import StudioService
from backend.llama.api import engine_headers
from backend.llama.load import Snapshot

__all__ = ["ServiceFactory", "long_text"]

#: `running_service(**settings)`: starts a service with these settings over the suite's.
ServiceFactory = Callable[..., Awaitable[StudioService]]
#: Words whose mixes make prompts no cache holds (`long_text`).
WORDS = ("river stone maple copper lantern orchard signal harbor velvet quartz meadow "
         "cinder falcon willow ember glacier thistle canyon saffron marble").split()


async def long_text(snapshot: Snapshot, tokens: int, seed: int) -> str:
    """A text of about `tokens` tokens, different for each seed (nothing of it cached)."""
    assert snapshot.serving is not None
    words = " ".join(WORDS[(i * seed + i // 7) % len(WORDS)] for i in range(tokens))
    async with httpx.AsyncClient(base_url=snapshot.serving.base_url,
                                 headers=engine_headers(snapshot.serving.api_key)) as engine:
        counted = len((await engine.post("/tokenize", json={"content": words})).json()["tokens"])
    return f"{seed} " + " ".join(words.split()[:tokens * tokens // counted])
