"""The failures of the gateway's upstream leg, raised by its HTTP/1.1 client
(`backend.port.upstream_http`) and by the parser of its answers (`backend.port.http1_response`).

`str()` of each says how it failed, for logs, not for clients: the relay translates them.
`ConnectFailed` (and its `ConnectTimeout`) is the only one that means nothing of the
request was sent, so that it may be sent again, here or elsewhere.
"""

from __future__ import annotations

__all__ = [
    "ConnectFailed", "ConnectTimeout", "ConnectionLost", "MalformedAnswer", "UnsupportedURL",
    "UpstreamError",
]


class UpstreamError(Exception):
    """The exchange with the upstream failed; `str()` says how (for logs, not clients)."""


class UnsupportedURL(UpstreamError):
    """Not an http(s) URL with a host: nothing was sent."""


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing of the request was sent, so it may be sent
    again, here or elsewhere."""


class ConnectTimeout(ConnectFailed):
    """Connecting took longer than the client's connect timeout."""


class MalformedAnswer(UpstreamError):
    """The upstream's answer broke HTTP/1.1 (its connection is closed, never reused), or
    was not the answer asked for."""


class ConnectionLost(UpstreamError):
    """The connection ended before the answer did."""
