"""The environment the engine's processes get: llama-server, its build tools, apt."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["engine_environment"]


def engine_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the engine's processes (llama-server, its build tools, apt):
    ours without the app's own settings (the port's key among them) and without
    credentials, which none of them needs: hub tokens and any *_TOKEN, *_API_KEY,
    *_SECRET, *_PASSWORD."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items() if not _is_withheld(name)}


def _is_withheld(name: str) -> bool:
    upper = name.upper()
    return (upper.startswith("GGUF_STUDIO_") or upper in _HUB_TOKENS
            or upper.endswith(("_TOKEN", "_API_KEY", "_SECRET", "_SECRET_KEY", "_PASSWORD")))


_HUB_TOKENS = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"})
