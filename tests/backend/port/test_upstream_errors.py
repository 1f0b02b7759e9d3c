"""The upstream leg's failures: which of them may be sent again."""

from __future__ import annotations

from backend.port.upstream_errors import (ConnectFailed, ConnectionLost, MalformedAnswer,
                                          UnsupportedURL, UpstreamError)


def test_every_failure_is_an_upstream_error_and_only_a_refusal_says_nothing_was_sent():
    for error in (UnsupportedURL, ConnectFailed, MalformedAnswer, ConnectionLost):
        assert issubclass(error, UpstreamError)
    assert not issubclass(ConnectionLost, ConnectFailed)
    assert not issubclass(MalformedAnswer, ConnectFailed)
