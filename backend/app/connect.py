"""`gguf-studio connect [NAME|URL]`: a teammate gets a key and a working client set-up.

1. Which port: the URL given (`http://10.0.0.5:8899`, or `10.0.0.5:8899`), else the
   ports that answer over mDNS within a few seconds (`backend.app.discovery`), chosen by
   NAME or by the user; when multicast finds nothing it says so and asks for the address.
2. Asks the port for a key under the teammate's name (`POST /v1/enrolments`) and shows
   the short code the owner sees beside the request.
3. Waits (long polls) while the owner approves (`gguf-studio keys approve CODE`, or the
   window) or refuses; the key comes once, over this connection.
4. Writes the key (0600 file), a Codex CLI profile and an OpenCode provider
   (`backend.app.client_config`), named after the port unless `--profile` names them,
   and says how to start each.

Everything a port or an announcement says (names, codes, messages) is printed through
`printable`: a rogue answer must not drive the teammate's terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
import time
from typing import Any

import httpx

from backend.app.client_config import profile_name, write_client_config
from backend.app.discovery import FoundPort, browse
from backend.app.snippets import ClientModel, ClientTarget
from backend.errors import ConnectFailed
from backend.models.hf_cache import printable

__all__ = ["add_connect_parser"]

ENROL_PATH = "/v1/enrolments"
#: Seconds one poll asks the port to hold the answer.
POLL_WAIT = 25


def add_connect_parser(sub: Any) -> None:
    connect = sub.add_parser(
        "connect", help="get a key from a GGUF Studio port on the LAN and set up Codex CLI "
        "and OpenCode for it",
        description="Finds GGUF Studio ports on the LAN (mDNS) or takes an address, asks the "
        "chosen one for a key under your name, waits for its owner to approve, then writes "
        "a Codex CLI profile and an OpenCode provider for its models (the key in a 0600 "
        "file, never in a config file; a backup of every file changed).")
    connect.add_argument("target", nargs="?", metavar="NAME|URL",
                         help="the port's announced name, or its address (http://HOST:PORT)")
    connect.add_argument("--name", help="the name your key gets (asked if not given)")
    connect.add_argument("--profile", help="the Codex profile and OpenCode provider to write "
                         "(default: the port's name)")
    connect.add_argument("--browse-seconds", type=float, default=3.0,
                         help="how long to listen for ports on the LAN (3)")
    connect.add_argument("--timeout", type=float, default=900.0,
                         help="seconds to wait for the owner's answer (900)")
    connect.add_argument("--qr", action="store_true",
                         help="also show the port's address as a QR code")
    connect.set_defaults(run=_connect)


def _connect(args: argparse.Namespace) -> int:
    return asyncio.run(_connect_async(args))


async def _connect_async(args: argparse.Namespace) -> int:
    started = time.monotonic()
    port_name, urls = await _choose_port(args.target, args.browse_seconds)
    async with httpx.AsyncClient(timeout=POLL_WAIT + 10, trust_env=False) as client:
        root = await _reachable(client, urls)
        if args.qr:
            _print_qr(root)
        name = args.name or _ask_name()
        answer = await client.post(root + ENROL_PATH, json={"name": name})
        request = _json(answer, f"{port_name} did not take the request")
        print(f"Asked {printable(port_name)} ({printable(root)}) for a key named "
              f"{printable(request.get('name'), 80)!r}.\n"
              f"Code: {printable(request.get('code'), 20)}  (the owner sees the same code "
              "beside your request)\nWaiting for the owner to approve...", flush=True)
        approved = await _wait(client, root + str(request["poll"]), args.timeout, port_name)
    described = approved["port"]
    target = ClientTarget(
        root + "/v1", described["model_id"], approved["api_key"], described["context_length"],
        described["max_output_tokens"], described["default_output_tokens"],
        others=tuple(ClientModel(m["model_id"], m["context_length"]) for m in described["others"]),
        small_model=described["small_model"], default_alias=described["default_alias"])
    # One profile per port: a second port's key never replaces the first's.
    profile = profile_name(args.profile or port_name)
    written = write_client_config(target, profile, port_name)
    print(f"Approved: key {printable(approved.get('name'), 80)!r} saved in {written.key_file} "
          "(private to you).")
    for path in written.files:
        print(f"  wrote {path}")
    for path in written.backups:
        print(f"  backup {path}")
    for note in written.notes:
        print(f"  {printable(note, 1000)}")
    print(f"Start Codex with: {printable(written.codex_command, 1000)}\n"
          f"Start OpenCode with: {printable(written.opencode_command, 1000)}\n"
          f"Connected in {time.monotonic() - started:.1f}s.", flush=True)
    return 0


async def _choose_port(target: str | None, seconds: float) -> tuple[str, list[str]]:
    """(the port's name, its root URLs to try)."""
    if target and _looks_like_address(target):
        url = target if "://" in target else f"http://{target}"
        url = url.rstrip("/").removesuffix("/v1")
        print(f"Using the address given, {url} (not looked up on the LAN).", flush=True)
        return url.split("//", 1)[1], [url]
    print(f"Looking for GGUF Studio ports on the LAN ({seconds:g}s)...", flush=True)
    found = await browse(seconds)
    if target:
        chosen = [p for p in found if p.name.casefold() == target.casefold()] or \
            [p for p in found if target.casefold() in p.name.casefold()]
    else:
        chosen = found
    if not found:
        raise ConnectFailed("No GGUF Studio port answered on the LAN (multicast found nothing: "
                            "the owner may not announce it, or this network drops mDNS). Give "
                            "its address instead: gguf-studio connect http://HOST:PORT")
    if not chosen:
        raise ConnectFailed(f"No port named {target!r} answered; found: "
                            + ", ".join(p.name for p in found) + ".")
    for i, port in enumerate(found, 1):
        print(f"  {i}. {printable(port.name, 80)}  {printable(', '.join(port.urls))}", flush=True)
    return _pick(chosen)


def _pick(ports: list[FoundPort]) -> tuple[str, list[str]]:
    if len(ports) == 1:
        print(f"Using {printable(ports[0].name, 80)}.", flush=True)
        return ports[0].name, ports[0].urls
    if not sys.stdin.isatty():
        raise ConnectFailed("Several ports answered: name one (gguf-studio connect NAME).")
    while True:
        text = input(f"Which one (1-{len(ports)})? ").strip()
        if text.isdigit() and 1 <= int(text) <= len(ports):
            port = ports[int(text) - 1]
            return port.name, port.urls


async def _reachable(client: httpx.AsyncClient, urls: list[str]) -> str:
    for url in urls:
        try:
            await client.get(url + "/health", timeout=3)
        except httpx.HTTPError:
            continue
        return url
    raise ConnectFailed("The port did not answer at " + ", ".join(urls) + ".")


async def _wait(client: httpx.AsyncClient, url: str, timeout: float,
                port_name: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wait = max(1, min(POLL_WAIT, int(deadline - time.monotonic())))
        try:
            answer = await client.get(url, params={"wait": wait})
        except httpx.TransportError as exc:
            raise ConnectFailed(f"Lost {port_name} while waiting ({type(exc).__name__}); "
                                "run gguf-studio connect again.") from None
        body = _json(answer, "The enrolment ended")
        if body.get("status") == "approved":
            return body
    raise ConnectFailed(f"The owner did not answer within {timeout:g}s; run gguf-studio "
                        "connect again later.")


def _json(answer: httpx.Response, what: str) -> dict[str, Any]:
    try:
        body = answer.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ConnectFailed(f"{what}: the answer is not GGUF Studio's (HTTP {answer.status_code}).")
    if answer.status_code >= 400:
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        raise ConnectFailed(f"{what}: {message or answer.status_code}")
    return body


def _ask_name() -> str:
    default = getpass.getuser()
    if not sys.stdin.isatty():
        return default
    return input(f"Your name for the key [{default}]: ").strip() or default


def _looks_like_address(text: str) -> bool:
    if "://" in text:
        return True
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit()


def _print_qr(url: str) -> None:
    import segno

    segno.make(url, micro=False).terminal(compact=True)
    print(url, flush=True)
