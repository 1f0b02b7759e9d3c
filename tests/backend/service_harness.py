"""What the tests that start a real service share (the fixtures are in conftest.py)."""

from __future__ import annotations

from typing import Awaitable, Callable

from backend.app.service import StudioService

__all__ = ["ServiceFactory"]

#: `running_service(**settings)`: starts a service with these settings over the suite's.
ServiceFactory = Callable[..., Awaitable[StudioService]]
