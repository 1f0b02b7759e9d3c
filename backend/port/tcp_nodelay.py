"""TCP_NODELAY on each of the port's connections, set by the port itself.

With Nagle's algorithm on, a small write (an answer's first event after its head) waits
for the ACK of the write before it, which a peer in a request/response pattern delays
by up to 40 ms: every answer on a kept-alive connection came about 20 ms late
(`bench/pool.py`'s closed loop).  asyncio's loop sets the option only on sockets made
with IPPROTO_TCP (an accepted socket takes the listening socket's protocol number, 0
where it was made without one), uvloop on every TCP socket: the port relies on neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

__all__ = ["send_at_once"]


def send_at_once(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on `transport`'s socket, if it is a TCP one."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # a connection already gone
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
