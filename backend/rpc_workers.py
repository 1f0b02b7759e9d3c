"""The RPC-workers setting: machines a load spreads the model over ("host:port", ...).

Each worker is a `gguf-studio rpc-worker` (llama.cpp's `ggml-rpc-server`) on another
machine; llama-server gets them as `--rpc host:port,...` and uses each as one more
device.  llama.cpp's client reaches workers over IPv4 only (it resolves names with
gethostbyname and splits an endpoint at its first colon), so an IPv6 address is refused
here with the reason rather than failing inside the engine.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from backend.errors import SettingsError

__all__ = ["DEFAULT_PORT", "parse_rpc_workers", "parse_rpc_worker"]

#: llama.cpp's rpc-server listens on this port unless told otherwise.
DEFAULT_PORT = 50052

_PORT = re.compile(r"[0-9]{1,5}")  # ASCII only: str.isdigit() takes "²", which int() refuses
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def parse_rpc_workers(raw: Any) -> tuple[str, ...]:
    """Workers from a setting: a list, or text separated by commas or spaces (as on the
    command line and in the environment).  Raises SettingsError naming the bad one."""
    if raw is None:
        return ()
    if isinstance(raw, (list, tuple)):
        parts = [str(part) for part in raw]
    elif isinstance(raw, str):
        parts = raw.replace(",", " ").split()
    else:
        raise SettingsError(f"RPC workers must be host:port values, not {raw!r}.")
    workers = tuple(parse_rpc_worker(part) for part in parts if part.strip())
    seen: set[str] = set()
    for worker in workers:
        if worker in seen:
            raise SettingsError(f"RPC worker {worker} is given twice; give each worker once.")
        seen.add(worker)
    return workers


def parse_rpc_worker(text: str) -> str:
    """One worker as "host:port" (the port may be left out: llama.cpp's default)."""
    value = text.strip()
    shown = value[:80]
    if value.startswith("[") or value.count(":") > 1:
        raise SettingsError(f"RPC worker {shown!r}: llama.cpp reaches RPC workers over IPv4 "
                            "only; give an IPv4 address or a host name, as host:port.")
    host, _, port_text = value.partition(":")
    if not host:
        raise SettingsError(f"RPC worker {shown!r} has no host; give it as host:port, "
                            f"e.g. 192.168.1.20:{DEFAULT_PORT}.")
    if not _is_host(host):
        raise SettingsError(f"RPC worker {shown!r}: {host[:80]!r} is not a host name or an "
                            "IPv4 address.")
    if not port_text:
        port = DEFAULT_PORT
    elif _PORT.fullmatch(port_text) and 1 <= int(port_text) <= 65535:
        port = int(port_text)
    else:
        raise SettingsError(f"RPC worker {shown!r}: the port must be a number from 1 to "
                            "65535.")
    return f"{host.lower()}:{port}"


def _is_host(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    if host.replace(".", "").isdigit():  # digits and dots that are no IPv4 address
        return False
    return bool(_HOST_NAME.match(host))
