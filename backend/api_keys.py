"""API keys for the OpenAI-compatible port: made here, shown masked, compared elsewhere."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from backend.errors import SettingsError

__all__ = ["KEY_PREFIX", "MIN_API_KEY_LENGTH", "check_api_key", "generate_api_key",
           "mask_api_key", "read_api_key_file"]

log = logging.getLogger("gguf_studio.settings")

# A recognisable prefix lets people (and secret scanners) tell the key apart from others.
KEY_PREFIX = "gs-"
#: The shortest key the port accepts.  A short key falls to online guessing however the
#: port throttles wrong keys (backend.port.access_guard answers every guess a client sends);
#: 16 characters of a random key are about 95 bits.
MIN_API_KEY_LENGTH = 16


def generate_api_key() -> str:
    """A new random key: 256 bits, URL- and shell-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def check_api_key(key: str) -> None:
    """SettingsError for a key the port refuses to run with (no key at all is fine here:
    whether the port may run without one is `check_bind_allowed`'s business)."""
    if key and len(key) < MIN_API_KEY_LENGTH:
        raise SettingsError(
            f"The API key is too short ({len(key)} characters): use at least "
            f"{MIN_API_KEY_LENGTH} characters, or a key the window makes (Generate key).")


def mask_api_key(key: str, visible: int = 4) -> str:
    """The key with all but its prefix and last `visible` characters hidden."""
    if not key:
        return ""
    prefix = KEY_PREFIX if key.startswith(KEY_PREFIX) else ""
    rest = key[len(prefix):]
    if len(rest) <= visible * 2:
        return prefix + "•" * len(rest)
    return prefix + "•" * 12 + rest[-visible:]


def read_api_key_file(path: str | Path) -> str:
    """The key held in the file at `path` (surrounding whitespace and the final newline
    dropped), so that the key never has to be written on a command line, where every
    local user can read it (`ps`)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "not readable text"
        raise SettingsError(f"The API key file {Path(path).name} cannot be read ({reason}).") from None
    if os.name != "nt" and Path(path).expanduser().stat().st_mode & 0o077:
        log.warning("The API key file %s can be read by other users; make it private "
                    "(chmod 600).", Path(path).name)
    key = text.strip()
    if not key:
        raise SettingsError(f"The API key file {Path(path).name} is empty.")
    if any(ch.isspace() or not ch.isprintable() for ch in key):
        raise SettingsError(f"The API key file {Path(path).name} must hold the key alone, "
                            "on one line without spaces.")
    return key
