"""Listeners: callbacks that all hear the same event, one failing never stopping the rest."""

from __future__ import annotations

import logging
from typing import Callable, Generic, ParamSpec

P = ParamSpec("P")


class Listeners(Generic[P]):
    """A list of callbacks called in order; a callback that raises is logged and skipped."""

    def __init__(self, logger: logging.Logger, what: str = "listener") -> None:
        self._callbacks: list[Callable[P, None]] = []
        self._log = logger
        self._what = what

    def add(self, callback: Callable[P, None]) -> None:
        self._callbacks.append(callback)

    def remove(self, callback: Callable[P, None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for callback in list(self._callbacks):
            try:
                callback(*args, **kwargs)
            except Exception:
                self._log.exception("%s %r failed", self._what, callback)
