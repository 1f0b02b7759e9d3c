"""The short code of an enrolment request, bound to the connection it came over.

The owner's port and the teammate's `connect` each work the code out on their own, from
what each sees of the one TCP connection the request travelled on: the requester's
address and the address (and port number) the port was reached at, with the name asked
for.  The port reads them off its socket, `connect` off its own (its local address and
the peer it reached).  With nothing in between the two pairs are the same, and so are
the codes on both screens.  A relay (a device announcing the owner's port name, then
passing requests on) terminates the teammate's connection and opens its own: the port
sees the relay's address and the teammate sees the relay as the port, so the codes
differ, whatever the relay writes into the answers it passes on.  All it chooses is the
name it forwards and its own addresses: it could try names until one gives the
teammate's code (about 2**30 hashes), but that name is the one the owner's screen shows
and the key would carry, so the owner checks the name with the code.

No secret is involved, so none can leak: the code grants nothing by itself (the owner's
approval does), and a requester elsewhere cannot make the port show a chosen code
without sending from the requester's address.  A NAT, VPN or tunnel between teammate
and port changes the addresses too: the codes then differ for an honest reason, which
`connect` names.  A device that takes over both machines' addresses on the link (ARP
spoofing) is not seen; that needs TLS.

`gguf-studio keys approve CODE` reads a code as people type it (`as_code`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re

__all__ = ["CODE_ALPHABET", "CODE_LETTERS", "as_code", "enrolment_code", "normal_address"]

#: The short code's letters: no 0/O, 1/I/L, so it reads aloud and types without doubt.
CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"
#: Letters in a code (31**6: about 2**30 codes), shown as two groups of three.
CODE_LETTERS = 6
_DOMAIN = b"gguf-studio enrolment code 1\0"


def enrolment_code(requester: str, port_host: str, port_number: int, name: str) -> str:
    """The code of a request named `name` from `requester` to the port reached at
    `port_host`:`port_number`, e.g. "K7Q-MX3"."""
    parts = [normal_address(requester), normal_address(port_host), str(int(port_number)),
             name.strip()]
    digest = hashlib.sha256(_DOMAIN + "\0".join(parts).encode("utf-8")).digest()
    number = int.from_bytes(digest, "big")  # 256 bits: the modulo's bias is negligible
    letters = []
    for _ in range(CODE_LETTERS):
        number, index = divmod(number, len(CODE_ALPHABET))
        letters.append(CODE_ALPHABET[index])
    half = CODE_LETTERS // 2
    return "".join(letters[:half]) + "-" + "".join(letters[half:])


def as_code(text: str) -> str | None:
    """`text` as a request's code ("abc def", "ABCDEF" -> "ABC-DEF"); None when it
    cannot be one (a name, say)."""
    letters = re.sub(r"[\s-]", "", text).upper()
    if len(letters) != CODE_LETTERS or any(c not in CODE_ALPHABET for c in letters):
        return None
    half = CODE_LETTERS // 2
    return f"{letters[:half]}-{letters[half:]}"


def normal_address(host: str) -> str:
    """One spelling per address, as both ends write it: an IPv4 address mapped into IPv6
    as IPv4, an IPv6 address compressed and without its zone; a name as given."""
    text = host.strip().strip("[]").split("%", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text.lower()
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)
