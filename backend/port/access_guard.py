"""Who may use the port: the API key, repeated wrong keys, and what a browser could send.

Every HTTP request passes `AccessGuard.screen` before it is routed:

* **Origin** (any mode).  A request carrying an `Origin` header comes from a web page.
  Pages served from this machine's loopback (`http://localhost:*`, `127.0.0.1`, `[::1]`)
  and the origins the user allowed (`--allow-origin`, like Ollama's `OLLAMA_ORIGINS`;
  `*` and `fnmatch` patterns such as `https://*.example.com`) get CORS headers and
  answered preflights; any other origin is refused with 403 `origin_not_allowed`.
* **Host** (without a key; with one, on the paths open without it: `/health`).  A name
  that is not this machine's (`localhost`, its host name, its addresses) nor one the
  user allowed (`--allow-host`) is refused with 403 `host_not_allowed`: that is what a
  DNS-rebinding page sends, and such a page must not read the model's and devices'
  names from `/health` either.
* **Content type** (only without a key).  A POST to a model route whose body is not declared JSON is
  refused with 415 `unsupported_content_type`: `text/plain`, forms and untyped bodies
  are what a page may send without a preflight.

With a key, the key is the guard (a page cannot add `Authorization` without a preflight,
which a foreign origin fails, nor knows the key after rebinding), so Host and content
type are left to the client on the routes that need it.

`check_key` compares the key in constant time and throttles repeated wrong keys per
client address: after `FREE_FAILURES` wrong keys in a row, a wrong key from that address
gets 429 `too_many_failed_keys` with `Retry-After` instead of 401 until the lockout ends
(1 s, doubled by each wrong key after a lockout, up to `MAX_LOCKOUT`); failures are
forgotten after `FORGET_FAILURES_AFTER` seconds without another.

Only a key that was *presented* and is wrong counts: a request without a key (what any
web page's `<img>` sends, or a client not set up yet) is a plain 401 and locks no one
out.  The right key always passes, during a lockout too, so a lockout slows the guesser
and never the rightful user behind the same address (one NAT, one machine).  For the
same reason the right key does not clear the address's record: a guesser sharing the
address with a working client stays throttled.  A guesser that ignores `Retry-After`
still has every guess answered, so the key itself is the real defence: at least
`MIN_API_KEY_LENGTH` characters (backend.api_keys), 256 random bits when generated.
"""

from __future__ import annotations

import fnmatch
import functools
import hmac
import ipaddress
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable
from urllib.parse import urlsplit

from starlette.types import Message, Scope, Send

from backend.errors import (ForbiddenHost, ForbiddenOrigin, TooManyKeyFailures, Unauthorized,
                            UnsupportedContentType)
from backend.addresses import lan_addresses
from backend.admission.caller import ADDRESS_FLOW, ANONYMOUS, Caller
from backend.keys.key_store import CHAT_NAME, OWNER, OWNER_CHAT, KeyRecord, KeyStore
from backend.settings import Settings

__all__ = ["FREE_FAILURES", "MAX_LOCKOUT", "AccessGuard", "Screening"]

FREE_FAILURES = 5
MAX_LOCKOUT = 60.0
#: Client addresses remembered by the throttle; the oldest are forgotten first.
MAX_TRACKED_CLIENTS = 4096
#: Failures older than this are forgotten (a typo last week does not count today).
FORGET_FAILURES_AFTER = 600.0
#: How long the machine's own addresses are trusted before they are asked for again.
ADDRESS_TTL = 30.0

PREFLIGHT_METHODS = "GET, POST, OPTIONS"
PREFLIGHT_MAX_AGE = "600"
EXPOSED_HEADERS = "Retry-After, Content-Type"


@dataclass
class Screening:
    """What `screen` decided for a request that may go on."""

    cors_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    preflight: bool = False
    requested_headers: bytes = b""  # a preflight's Access-Control-Request-Headers

    def wrap(self, send: Send) -> Send:
        """`send` with the CORS headers added to the answer's head."""
        if not self.cors_headers:
            return send
        extra = self.cors_headers

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)
        return send_with_cors

    async def answer_preflight(self, send: Send) -> None:
        headers = [*self.cors_headers,
                   (b"access-control-allow-methods", PREFLIGHT_METHODS.encode()),
                   (b"access-control-max-age", PREFLIGHT_MAX_AGE.encode()),
                   (b"content-length", b"0")]
        if self.requested_headers:
            headers.append((b"access-control-allow-headers", self.requested_headers))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class AccessGuard:
    """The checks of one port; `settings` is read per request (it may change live)."""

    def __init__(self, settings: Callable[[], Settings], *, json_paths: Iterable[str] = (),
                 keyless_paths: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic,
                 own_addresses: Callable[[], set[str]] | None = None,
                 keys: Callable[[], KeyStore | None] = lambda: None,
                 chat_secret: Callable[[], str] = lambda: "") -> None:
        self._settings = settings
        self._keys = keys
        self._chat_secret = chat_secret
        self._json_paths = frozenset(json_paths)
        self._keyless_paths = frozenset(keyless_paths)
        self.clock = clock
        self.free_failures = FREE_FAILURES
        self._own_addresses = own_addresses or _machine_addresses
        self._addresses: set[str] = set()
        self._addresses_at = float("-inf")
        self._failures: OrderedDict[str, _Failures] = OrderedDict()

    # --- before routing ---------------------------------------------------------------

    def screen(self, scope: Scope) -> Screening:
        """Raise the refusal for a request a browser page may not make; else say which
        CORS headers its answer carries and whether it is a preflight to answer here."""
        settings = self._settings()
        headers = _headers(scope)
        screening = Screening()
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1").strip()
            if not self.origin_allowed(text, settings):
                raise ForbiddenOrigin(
                    "Requests from web pages of this origin are not allowed. Start the server "
                    "with --allow-origin ORIGIN (or GGUF_STUDIO_ALLOW_ORIGINS) to allow it.")
            screening.cors_headers = [(b"access-control-allow-origin", origin.strip()),
                                      (b"vary", b"Origin"),
                                      (b"access-control-expose-headers", EXPOSED_HEADERS.encode())]
            if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
                screening.preflight = True
                screening.requested_headers = headers.get(b"access-control-request-headers", b"")
                return screening
        if settings.api_key and scope["path"] not in self._keyless_paths:
            return screening
        host = headers.get(b"host")
        if host is not None and not self.host_allowed(host.decode("latin-1"), settings):
            raise ForbiddenHost(
                "This server does not answer to that host name. Use its address, or start it "
                "with --allow-host NAME (or GGUF_STUDIO_ALLOW_HOSTS) to allow the name.")
        if settings.api_key:
            return screening
        if (scope["method"] == "POST" and scope["path"] in self._json_paths
                and not _is_json(headers.get(b"content-type"))):
            raise UnsupportedContentType(
                "Send the request body as JSON, with 'Content-Type: application/json'.")
        return screening

    def origin_allowed(self, origin: str, settings: Settings) -> bool:
        origin = origin.lower().rstrip("/")
        parts = _origin_parts(origin)
        if parts is None and origin != "null":  # "null": a sandboxed or file:// page
            return False  # not scheme://host[:port]: no browser sends that
        for pattern in _entries(settings.allow_origins):
            if fnmatch.fnmatchcase(origin, pattern.lower().rstrip("/")):
                return True
        return parts is not None and parts[0] in {"http", "https"} and _is_loopback_name(parts[1])

    def host_allowed(self, host: str, settings: Settings) -> bool:
        name = _strip_port(host.strip().lower()).rstrip(".")
        if not name:
            return False
        if _is_loopback_name(name):
            return True
        allowed = {entry.lower().rstrip(".") for entry in _entries(settings.allow_hosts)}
        if "*" in allowed or name in allowed:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return name in _machine_names()
        if address.is_unspecified:
            return True
        return str(address) in self._machine_addresses()

    # --- the key ------------------------------------------------------------------------

    def check_key(self, scope: Scope) -> Caller:
        """Who sends the request: the owner's key, a named key, or (with no key set) the
        client's address; raise unless it carries a right key when keys are set.  Wrong
        keys from one client address are throttled after repeated failures, missing
        ones never, and a right key always passes."""
        client = str((scope.get("client") or ("unknown", 0))[0])
        owner = self._settings().api_key
        store = self._keys()
        named = store is not None and store.requires_keys()
        chat = self._chat_secret()
        if chat and _matches(_presented_keys(scope["headers"]), chat.encode()):
            return Caller(CHAT_NAME, OWNER_CHAT)  # the window's Chat tab, keys or none
        if not owner and not named:
            return Caller(ADDRESS_FLOW + client)
        record = self._failures.get(client)
        now = self.clock()
        if record is not None and now - record.last_failure > FORGET_FAILURES_AFTER:
            del self._failures[client]
            record = None
        presented = _presented_keys(scope["headers"])
        if not presented:
            raise Unauthorized("Missing API key. Send it as 'Authorization: Bearer KEY' "
                               "or as 'x-api-key: KEY'.")
        if owner and _matches(presented, owner.encode()):
            return Caller(OWNER.name if named else ADDRESS_FLOW + client, OWNER)
        if store is not None:
            for given in presented:
                found = store.authenticate(given.decode("utf-8", "replace"))  # 401 if revoked
                if found is not None:
                    return Caller(found.name, found)
        if record is not None and record.locked_until > now:
            raise TooManyKeyFailures(
                "Too many requests with a wrong API key from this address. Wait, then "
                "send the right key.", retry_after=record.locked_until - now)
        self._note_failure(client, now)
        raise Unauthorized("Incorrect API key.")

    def _note_failure(self, client: str, now: float) -> None:
        record = self._failures.pop(client, None) or _Failures()
        record.count += 1
        record.last_failure = now
        if record.count >= self.free_failures:
            record.locked_until = now + min(MAX_LOCKOUT, 2.0 ** (record.count - self.free_failures))
        self._failures[client] = record
        while len(self._failures) > MAX_TRACKED_CLIENTS:
            self._failures.popitem(last=False)

    def _machine_addresses(self) -> set[str]:
        now = self.clock()
        if now - self._addresses_at > ADDRESS_TTL:
            self._addresses = self._own_addresses()
            self._addresses_at = now
        return self._addresses


@dataclass
class _Failures:
    count: int = 0
    last_failure: float = float("-inf")
    locked_until: float = float("-inf")


def _presented_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The non-empty keys a request presents: the first `Authorization` header's bearer
    and the first `x-api-key` (one of each: repeating the headers must not turn one
    request into many guesses)."""
    keys = []
    seen: set[bytes] = set()
    for name, value in headers:
        if name in seen or name not in (b"authorization", b"x-api-key"):
            continue
        seen.add(name)
        if name == b"authorization":
            scheme, _, rest = value.partition(b" ")
            value = rest if scheme.lower() == b"bearer" else b""
        if value.strip():
            keys.append(value.strip())
    return keys


def _matches(presented: list[bytes], expected: bytes) -> bool:
    """Whether any presented key is the key, each compared in constant time."""
    matched = False
    for given in presented:
        matched |= hmac.compare_digest(given, expected)
    return matched


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name; the first of repeated ones."""
    out: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        out.setdefault(name, value)
    return out


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/")
                                            and media.endswith(b"+json"))


def _entries(values: list[str]) -> list[str]:
    """Settings entries, which the environment may give comma-separated."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _origin_parts(origin: str) -> tuple[str, str] | None:
    """(scheme, host name) of an origin as a browser sends it (scheme://host[:port]),
    parsed by a URL parser; None for anything else, such as
    `http://localhost:80@evil.com`, whose host is evil.com, or a path after the host."""
    try:
        url = urlsplit(origin)
        url.port  # noqa: B018 - raises ValueError for a port that is no port
    except ValueError:
        return None
    if not url.scheme or not url.hostname or "@" in url.netloc or url.path or url.query \
            or url.fragment or not origin.startswith(f"{url.scheme}://"):
        return None
    return url.scheme, url.hostname


def _strip_port(host: str) -> str:
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


@functools.lru_cache(maxsize=64)  # a few names per port; parsing one is most of a check
def _is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _machine_names() -> set[str]:
    import socket

    name = socket.gethostname().lower().rstrip(".")
    short = name.split(".", 1)[0]
    return {name, short, short + ".local"}


def _machine_addresses() -> set[str]:

    return set(lan_addresses())
