"""`not_none(x)`: x, which the test expects to be there; a clear failure when it is None.

For values typed `T | None` that a test reads inside one expression, where a separate
`assert x is not None` line would not fit (mypy checks the tests' bodies).
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["not_none"]

T = TypeVar("T")


def not_none(value: T | None) -> T:
    assert value is not None, "expected a value, got None"
    return value
