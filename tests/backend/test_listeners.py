"""Listeners: every callback hears each event, in order, even when one of them fails."""

from __future__ import annotations

import logging

import pytest

from backend.listeners import Listeners


def test_a_failing_listener_is_logged_and_the_others_still_hear(caplog: pytest.LogCaptureFixture) -> None:
    heard: list[tuple[str, int]] = []
    listeners: Listeners[[int]] = Listeners(logging.getLogger("test.listeners"), "test listener")

    def broken(value: int) -> None:
        raise ValueError("boom")

    listeners.add(lambda value: heard.append(("first", value)))
    listeners.add(broken)
    listeners.add(lambda value: heard.append(("last", value)))
    with caplog.at_level(logging.ERROR, "test.listeners"):
        listeners(7)
    assert heard == [("first", 7), ("last", 7)]
    assert "test listener" in caplog.text and "boom" in caplog.text

    listeners.remove(broken)
    listeners.remove(broken)  # removing twice is harmless
    caplog.clear()
    listeners(8)
    assert heard[-2:] == [("first", 8), ("last", 8)] and not caplog.text
