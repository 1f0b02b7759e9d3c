"""TOML values written by hand: the standard library reads TOML (tomllib) but writes none.

The models file (`backend.app.pool.models_file`) and the Codex snippet (`backend.app.sharing.snippets`)
hold only strings, whole numbers, decimals, booleans and lists of strings, which these
few functions write exactly as `tomllib` reads them back.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["toml_key", "toml_string", "toml_value"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(value: str) -> str:
    """A basic string: quotes, backslashes and control characters (DEL included)
    escaped, everything else as it is (TOML strings are Unicode)."""
    out = []
    for ch in value:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    """A key, bare where TOML allows it, quoted otherwise."""
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML holds no {value!r} here")
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")
