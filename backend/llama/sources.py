"""The engine's sources: one pinned file from the package index, checked before any use.

Why not `pip download`: measured with pip 26.3 against a local index serving an sdist
whose build backend writes a marker file when imported,
- without hashes, pip imports the sdist's build backend (to read its metadata) before
  anything is checked: the marker appears;
- with `--require-hashes` a tampered sdist is refused before that, but once the hash
  matches pip still prepares the metadata: it installs the backend's build requirements
  from the index, checking no hash, and runs them (with `--no-build-isolation` it runs
  the sdist's backend in our own environment instead).
The build needs only the files, so the index is read here (PEP 503, the index pip is
configured with) and the one file streamed to disk, counted and hashed; it is handed on
only when its size and SHA-256 are the pinned ones.  Nothing the index sends is
unpacked, imported or run before that, and it cannot send more than the pinned size.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import os
import ssl
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

import certifi
import httpx

from backend.errors import EngineBuildFailed

__all__ = ["DEFAULT_INDEX", "PinnedFile", "fetch_pinned"]

DEFAULT_INDEX = "https://pypi.org/simple"

# What an index page may weigh (PyPI's page for llama-cpp-python is well under 1 MiB).
_PAGE_BYTES = 16 << 20
_CHUNK = 1 << 16


@dataclass(frozen=True)
class PinnedFile:
    project: str  # the PEP 503 normalized name, e.g. "llama-cpp-python"
    filename: str
    sha256: str
    size: int
    what: str  # how messages name it, e.g. "the llama.cpp sources"


async def fetch_pinned(pinned: PinnedFile, dest: Path,
                       progress: Callable[[int], None] = lambda received: None) -> None:
    """Write `pinned` to `dest` from the first index pip is configured with that offers it
    (its index-url, then its extra-index-urls; PyPI when pip names none), calling
    `progress` with the bytes received so far.  Raises EngineBuildFailed, and leaves no
    `dest`, when no index offers it or what came is not the pinned file."""
    config = await asyncio.to_thread(_PipConfig.read)
    indexes = [config.index_url or DEFAULT_INDEX, *config.extra_index_urls]
    async with httpx.AsyncClient(follow_redirects=True, timeout=httpx.Timeout(60.0),
                                 verify=_tls_context(config.cert),
                                 headers={"Accept-Encoding": "identity"}) as client:
        for index in indexes:
            link = await _find_link(client, index, pinned)
            if link is not None:
                break
        else:
            raise EngineBuildFailed(f"No package index offers {pinned.filename} (asked "
                                    f"{', '.join(map(_origin, indexes))}, pip's index-url and "
                                    "extra-index-url; file:// indexes are not read).")
        try:
            await _download(client, link, pinned, dest, progress, _auth_for(link, index))
        except BaseException:
            dest.unlink(missing_ok=True)
            raise


# --- helpers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PipConfig:
    index_url: str = ""
    extra_index_urls: tuple[str, ...] = ()
    cert: str = ""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "_PipConfig":
        """What `pip config list` says (the environment over pip's download section over
        its global one), as pip itself would apply it to `pip download`."""
        environ = os.environ if environ is None else environ
        if getattr(sys, "frozen", False):  # an app bundle has no pip; its environment only
            return cls(environ.get("PIP_INDEX_URL", ""),
                       tuple(environ.get("PIP_EXTRA_INDEX_URL", "").split()), environ.get("PIP_CERT", ""))
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=dict(environ),
                                  capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return cls()
        values: dict[str, str] = {}
        for line in done.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                try:
                    values[key] = str(ast.literal_eval(value))
                except (ValueError, SyntaxError):
                    continue

        def get(option: str) -> str:
            return next((values[f"{section}.{option}"] for section in (":env:", "download", "global")
                         if f"{section}.{option}" in values), "")

        return cls(get("index-url"), tuple(get("extra-index-url").split()), get("cert"))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


async def _find_link(client: httpx.AsyncClient, index: str, pinned: PinnedFile) -> str | None:
    """The URL `index` gives for the pinned file, or None when it does not list it."""
    if urlsplit(index).scheme not in ("http", "https"):
        return None  # pip's file:// indexes are not read here
    page_url = f"{index.rstrip('/')}/{pinned.project}/"
    try:
        async with client.stream("GET", page_url, headers={"Accept": "text/html"}) as response:
            if response.status_code == 404:
                return None
            if response.status_code != 200:
                raise EngineBuildFailed(f"The package index {_origin(index)} answered "
                                        f"{response.status_code} for {pinned.project}.")
            page = bytearray()
            async for chunk in response.aiter_bytes():
                page += chunk
                if len(page) > _PAGE_BYTES:
                    raise EngineBuildFailed(f"The package index {_origin(index)} sent a page "
                                            f"over {_PAGE_BYTES >> 20} MiB for {pinned.project}.")
            base = str(response.url)
    except httpx.HTTPError as exc:
        raise EngineBuildFailed(f"Reading the package index {_origin(index)} failed: "
                                f"{_reason(exc)}.") from None
    links = _Links()
    links.feed(page.decode("utf-8", errors="replace"))
    for href in links.hrefs:
        url = urldefrag(urljoin(base, href)).url
        if unquote(urlsplit(url).path.rsplit("/", 1)[-1]) == pinned.filename:
            return url
    return None


async def _download(client: httpx.AsyncClient, url: str, pinned: PinnedFile, dest: Path,
                    progress: Callable[[int], None], auth: httpx.Auth | None) -> None:
    digest = hashlib.sha256()
    received = 0
    try:
        async with client.stream("GET", url, auth=auth) as response:
            if response.status_code != 200:
                raise EngineBuildFailed(f"Fetching {pinned.what} from {_origin(url)} failed "
                                        f"(HTTP {response.status_code}).")
            with dest.open("wb") as out:
                async for chunk in response.aiter_raw(_CHUNK):  # the file's bytes, not decoded
                    received += len(chunk)
                    if received > pinned.size:
                        raise EngineBuildFailed(
                            f"{pinned.what.capitalize()} from {_origin(url)} are longer than the "
                            f"pinned ones ({pinned.size} bytes); refusing to build them.")
                    digest.update(chunk)
                    out.write(chunk)
                    progress(received)
    except httpx.HTTPError as exc:
        raise EngineBuildFailed(f"Fetching {pinned.what} from {_origin(url)} failed: "
                                f"{_reason(exc)}.") from None
    got = digest.hexdigest()
    if received != pinned.size or got != pinned.sha256:
        raise EngineBuildFailed(f"{pinned.what.capitalize()} failed their hash check (got "
                                f"{got[:16]}…, {received} bytes); refusing to build them.")


def _tls_context(cert: str) -> ssl.SSLContext:
    """The system's trust store and certifi's, and the bundle pip is told to trust."""
    context = ssl.create_default_context()
    context.load_verify_locations(certifi.where())
    if cert:
        try:
            context.load_verify_locations(cert)
        except (OSError, ssl.SSLError):
            pass
    return context


def _auth_for(url: str, index: str) -> httpx.Auth | None:
    """The index URL's credentials, for a file on the index's own origin only."""
    file_url, index_url = urlsplit(url), urlsplit(index)
    same_origin = (file_url.scheme, file_url.hostname, file_url.port) == \
        (index_url.scheme, index_url.hostname, index_url.port)
    if same_origin and index_url.username is not None and file_url.username is None:
        return httpx.BasicAuth(unquote(index_url.username), unquote(index_url.password or ""))
    return None


def _origin(url: str) -> str:
    """A URL's scheme and host, without credentials or path, for messages."""
    parts = urlsplit(url)
    if not parts.hostname:  # file:///a/local/index
        return f"{parts.scheme}://{parts.path}"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}"


def _reason(exc: httpx.HTTPError) -> str:
    return str(exc) or type(exc).__name__
