"""When the port takes enrolment requests: only while the owner accepts them (announced on
the network, or an accept window open), on a port that requires keys with enrolment on."""

from __future__ import annotations

import pytest

from backend.keys.enrolment_window import (ACCEPTING, ANNOUNCED, MAX_ACCEPT_MINUTES, NO_KEY,
                                      NOT_ACCEPTING, TURNED_OFF, EnrolmentWindow,
                                      accepting_until, enrolment_window)
from backend.errors import SettingsError
from backend.settings import Settings

NOW = 1_800_000_000.0
LAN = Settings(host="0.0.0.0", api_key="owner-key-0123456789abcdef")


def window(settings: Settings, keys_required: bool = True, now: float = NOW) -> EnrolmentWindow:
    return enrolment_window(settings, keys_required=keys_required, now=now)


def test_a_port_with_keys_is_closed_to_enrolment_until_the_owner_accepts_requests():
    closed = window(LAN)
    assert (closed.open, closed.reason, closed.until) == (False, NOT_ACCEPTING, None)
    assert "announce the port" in closed.describe()
    assert "--accept-enrolments MINUTES" in closed.closed_message()


def test_an_accept_window_opens_it_until_its_end_and_not_a_second_longer():
    settings = LAN.replace(accept_enrolments_until=accepting_until(10, now=NOW))
    assert window(settings) == EnrolmentWindow(True, ACCEPTING, NOW + 600)
    assert window(settings, now=NOW + 599.9).open
    ended = window(settings, now=NOW + 600)
    assert (ended.open, ended.reason) == (False, NOT_ACCEPTING)
    # What was asked while it was open is still answered; nothing new is taken.
    assert ended.answers_polls


def test_announcing_the_port_on_the_network_opens_it_for_as_long_as_it_is_announced():
    announced = window(LAN.replace(advertise=True))
    assert (announced.open, announced.reason, announced.until) == (True, ANNOUNCED, None)
    assert "while the port is announced" in announced.describe()
    # Announcing is asked for, but a port on loopback is never announced: not open.
    assert not window(LAN.replace(advertise=True, host="127.0.0.1")).open


def test_no_key_or_enrolment_turned_off_keeps_it_closed_whatever_else_the_owner_asked():
    asked = LAN.replace(advertise=True, accept_enrolments_until=NOW + 600)
    no_key = window(asked, keys_required=False)
    turned_off = window(asked.replace(allow_enrolment=False))
    assert (no_key.open, no_key.reason) == (False, NO_KEY)
    assert (turned_off.open, turned_off.reason) == (False, TURNED_OFF)
    assert not no_key.answers_polls and not turned_off.answers_polls
    assert "requires no key" in no_key.closed_message()
    # The switch the owner turned on still shows (it opens once keys are required).
    assert no_key.until == NOW + 600


def test_health_tells_the_owner_until_when_in_utc():
    settings = LAN.replace(accept_enrolments_until=1_800_000_600.0)
    assert window(settings).to_dict() == {"open": True, "reason": ACCEPTING,
                                          "accepting_until": "2027-01-15T08:10:00+00:00"}


def test_an_accept_window_is_at_most_a_day_and_zero_closes_it():
    assert accepting_until(0, now=NOW) == 0.0
    assert accepting_until(MAX_ACCEPT_MINUTES, now=NOW) == NOW + MAX_ACCEPT_MINUTES * 60
    for wrong in (-1, MAX_ACCEPT_MINUTES + 1, float("nan")):
        with pytest.raises(SettingsError, match="0 to 1440 minutes"):
            accepting_until(wrong, now=NOW)
