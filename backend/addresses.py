"""This machine's network addresses, and what clients should be told to use.

Asks the kernel only; sends nothing.  The port's Host check (which names are this
machine's) and the service's client URLs both read them.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["client_urls", "is_loopback", "lan_addresses"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_urls(host: str, port: int) -> list[str]:
    """The base URLs to give clients: every address of this machine when bound to all."""
    if host in {"0.0.0.0", "::", ""}:
        hosts = lan_addresses() or ["127.0.0.1"]
    else:
        hosts = [host]
    return [f"http://{_bracket(h)}:{port}/v1" for h in hosts]


def lan_addresses() -> list[str]:
    """This machine's IPv4 addresses, loopback last."""
    found: set[str] = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.add(str(info[4][0]))
    except OSError:
        pass
    found.update(_interface_addresses())
    found.add("127.0.0.1")
    return sorted(found, key=lambda a: (ipaddress.ip_address(a).is_loopback, a))


def _interface_addresses() -> set[str]:
    """IPv4 address of every network interface (Linux); asks the kernel, sends nothing."""
    try:
        import fcntl
        import struct
    except ImportError:
        return set()
    SIOCGIFADDR = 0x8915
    found = set()
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found.add(socket.inet_ntoa(packed[20:24]))
    return found


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
