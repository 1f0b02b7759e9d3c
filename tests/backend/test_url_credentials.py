"""A URL's userinfo (http://user:password@host) never reaches a log."""

from __future__ import annotations

import logging

import pytest

from backend.url_credentials import UrlCredentialsFilter, hide_url_credentials


@pytest.mark.parametrize("text, shown", [
    ("http://user:pw@10.0.0.2:8080/v1", "http://***@10.0.0.2:8080/v1"),
    ("joins: HTTPS://u@h and http://a:b@c/x?y=1@z", "joins: HTTPS://***@h and http://***@c/x?y=1@z"),
    ("http://localhost:80@evil.com", "http://***@evil.com"),
    ("mail me@example.com about http://host:8080/path", "mail me@example.com about http://host:8080/path"),
])
def test_the_userinfo_of_every_url_is_hidden_and_nothing_else(text, shown):
    assert hide_url_credentials(text) == shown


def test_a_log_record_naming_such_a_url_is_written_without_it():
    record = logging.LogRecord("gguf_studio.remote_engine", logging.INFO, __file__, 1,
                               "%s leaves: %s", ("http://u:hunter2@box:8080", "gone"), None)
    assert UrlCredentialsFilter().filter(record)
    assert record.getMessage() == "http://***@box:8080 leaves: gone"
