"""API keys for the OpenAI-compatible port: made here, shown masked, compared elsewhere."""

from __future__ import annotations

import secrets

__all__ = ["KEY_PREFIX", "generate_api_key", "mask_api_key"]

# A recognisable prefix lets people (and secret scanners) tell the key apart from others.
KEY_PREFIX = "gs-"


def generate_api_key() -> str:
    """A new random key: 256 bits, URL- and shell-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def mask_api_key(key: str, visible: int = 4) -> str:
    """The key with all but its prefix and last `visible` characters hidden."""
    if not key:
        return ""
    prefix = KEY_PREFIX if key.startswith(KEY_PREFIX) else ""
    rest = key[len(prefix):]
    if len(rest) <= visible * 2:
        return prefix + "•" * len(rest)
    return prefix + "•" * 12 + rest[-visible:]
