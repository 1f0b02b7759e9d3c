"""A key's expiry as people type it: dates, moments, spans and never, and the mistakes
explained."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from backend.errors import KeyStoreError
from backend.keys.expiry import describe_recent, parse_expiry
from tests.not_none import not_none


def test_a_date_means_through_the_end_of_that_local_day():
    now = datetime(2030, 3, 10, 12, 0).timestamp()
    expires = parse_expiry("2030-03-31", now)
    assert datetime.fromtimestamp(not_none(expires)) == datetime(2030, 4, 1, 0, 0)


def test_a_moment_spans_and_never_are_understood():
    now = datetime(2030, 3, 10, 12, 0).timestamp()
    assert datetime.fromtimestamp(not_none(parse_expiry("2030-03-31T18:30", now))) == datetime(2030, 3, 31, 18, 30)
    assert parse_expiry("2030-03-31T18:30:00Z", now) == datetime.fromisoformat(
        "2030-03-31T18:30:00+00:00").timestamp()
    assert parse_expiry("30d", now) == now + 30 * 86400
    assert parse_expiry("12h", now) == now + 12 * 3600
    assert parse_expiry("2w", now) == now + 14 * 86400
    assert parse_expiry("never", now) is None


@pytest.mark.parametrize("text, message", [
    ("2020-01-01", "is in the past"),
    ("next tuesday", "is not a date"),
    ("2030-02-30", "is not a date"),
    ("0d", "at least 1h"),
])
def test_unusable_expiry_dates_are_explained(text, message):
    now = (datetime(2030, 3, 10) - timedelta(hours=1)).timestamp()
    with pytest.raises(KeyStoreError, match=message):
        parse_expiry(text, now)


def test_a_recent_moment_reads_as_its_time_today_and_as_its_day_before():
    now = datetime(2030, 3, 10, 12, 0).timestamp()
    assert describe_recent(datetime(2030, 3, 10, 9, 5).timestamp(), now) == "09:05"
    assert describe_recent(datetime(2030, 3, 9, 23, 59).timestamp(), now) == "2030-03-09"
