"""`gguf-studio connect [NAME|URL]`: a teammate gets a key and a working client set-up.

1. Which port: the URL given (`http://10.0.0.5:8899`, or `10.0.0.5:8899`), else the
   ports that answer over mDNS within a few seconds (`backend.app.sharing.discovery`), chosen by
   NAME or by the user; when multicast finds nothing it says so and asks for the address.
   A name several ports answer to (the owner's and a device that took its name, which
   zeroconf then renamed `NAME-2`) is never chosen silently: they are listed with their
   addresses, and the user chooses, or is told to give the address.  The address used is
   printed.
2. Asks the port for a key under the teammate's name (`POST /v1/enrolments`) and shows
   the short code, worked out here from this end of the connection
   (`backend.keys.enrolment_code`): the owner's screen shows the same code only when nothing
   relays the connection.  The port's answer says where it sees the teammate from; a
   difference is printed as a warning.  The port's own copy of the code is never shown
   (a relay would pass it on).
3. Waits (long polls) while the owner approves (`gguf-studio keys approve CODE`, or the
   window) or refuses; the key comes once, over this connection.
4. Writes the key (0600 file), a Codex CLI profile, an OpenCode provider and a Claude Code
   settings file (`backend.app.sharing.client_config`), named after the port unless
   `--profile` names them, and says how to start each.

Everything a port or an announcement says (names, codes, messages) is printed through
`printable`: a rogue answer must not drive the teammate's terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import re
import sys
import time
from typing import Any
from urllib.parse import quote

import httpx

from backend.api_paths import ENROLMENTS, HEALTH
from backend.app.sharing.client_config import profile_name, write_client_config
from backend.app.sharing.discovery import FoundPort, browse
from backend.keys.enrolment_code import enrolment_code, normal_address
from backend.app.sharing.snippets import ClientModel, ClientTarget
from backend.errors import ConnectCommandFailed
from backend.models.hf_cache import printable

__all__ = ["add_connect_parser"]

#: Seconds one poll asks the port to hold the answer.
POLL_WAIT = 25


def add_connect_parser(sub: Any) -> None:
    connect = sub.add_parser(
        "connect", help="get a key from a GGUF Studio port on the LAN and set up Codex CLI, "
        "OpenCode and Claude Code for it",
        description="Finds GGUF Studio ports on the LAN (mDNS) or takes an address, asks the "
        "chosen one for a key under your name, waits for its owner to approve, then writes "
        "a Codex CLI profile, an OpenCode provider and a Claude Code settings file for its "
        "models (the key in a 0600 file, never in a config file; a backup of every file "
        "changed).")
    connect.add_argument("target", nargs="?", metavar="NAME|URL",
                         help="the port's announced name, or its address (http://HOST:PORT)")
    connect.add_argument("--name", help="the name your key gets (asked if not given)")
    connect.add_argument("--profile", help="the Codex profile, OpenCode provider and Claude "
                         "Code settings to write (default: the port's name)")
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
        print(f"Connecting to {printable(port_name, 80)} at {printable(root)}.", flush=True)
        if args.qr:
            _print_qr(root)
        name = (args.name or _ask_name()).strip()
        async with client.stream("POST", root + ENROLMENTS, json={"name": name}) as answer:
            ends = _ends(answer)  # while the connection is surely open
            await answer.aread()
        request = _json(answer, f"{printable(port_name, 80)} did not take the request")
        _say_code(name, ends, request)
        poll = f"{root}{ENROLMENTS}/{quote(str(request.get('id', '')), safe='')}"
        approved = await _wait(client, poll, args.timeout, port_name)
    described = approved["port"]
    target = ClientTarget(
        root + "/v1", described["model_id"], approved["api_key"], described["context_length"],
        described["max_output_tokens"], described["default_output_tokens"],
        others=tuple(ClientModel(m["model_id"], m["context_length"]) for m in described["others"]),
        small_model=described["small_model"], default_alias=described["default_alias"])
    # One profile per port: a second port's key never replaces the first's.
    profile = profile_name(args.profile or port_name)
    written = write_client_config(target, profile, port_name)
    print(f"Approved: key '{printable(approved.get('name'), 80)}' saved in {written.key_file} "
          "(private to you).")
    for path in written.files:
        print(f"  wrote {path}")
    for path in written.backups:
        print(f"  backup {path}")
    for note in written.notes:
        print(f"  {printable(note, 1000)}")
    print(f"Start Codex with: {printable(written.codex_command, 1000)}\n"
          f"Start OpenCode with: {printable(written.opencode_command, 1000)}\n"
          f"Start Claude Code with: {printable(written.claude_command, 1000)}\n"
          f"Connected in {time.monotonic() - started:.1f}s.", flush=True)
    return 0


async def _choose_port(target: str | None, seconds: float) -> tuple[str, list[str]]:
    """(the port's name, its root URLs to try)."""
    if target and _looks_like_address(target):
        url = target if "://" in target else f"http://{target}"
        url = url.rstrip("/").removesuffix("/v1")
        print(f"Using the address given, {printable(url)} (not looked up on the LAN).",
              flush=True)
        return url.split("//", 1)[1], [url]
    print(f"Looking for GGUF Studio ports on the LAN ({seconds:g}s)...", flush=True)
    found = await browse(seconds)
    if not found:
        raise ConnectCommandFailed(
            "No GGUF Studio port answered on the LAN (multicast found nothing: the owner may "
            "not announce it, or this network drops mDNS). Give its address instead: "
            "gguf-studio connect http://HOST:PORT")
    for i, port in enumerate(found, 1):
        print(f"  {i}. {printable(port.name, 80)}  {printable(', '.join(port.urls))}", flush=True)
    if target:
        # The name and the names zeroconf gives when another device holds it: a device
        # that announced "office" first leaves the owner's port "office-2".
        family = _family(target)
        chosen = [p for p in found if _family(p.name) == family] or \
            [p for p in found if target.casefold() in p.name.casefold()]
        if not chosen:
            raise ConnectCommandFailed(f"No port named '{printable(target, 80)}' answered; found: "
                                       + ", ".join(printable(p.name, 80) for p in found) + ".")
    else:
        chosen = found
    return _pick(chosen, target)


def _pick(ports: list[FoundPort], target: str | None) -> tuple[str, list[str]]:
    if len(ports) == 1:
        print(f"Using {printable(ports[0].name, 80)}.", flush=True)
        return ports[0].name, ports[0].urls
    listing = "".join(f"\n  {printable(p.name, 80)} at {printable(', '.join(p.urls))}"
                      for p in ports)
    if target:
        why = (f"Several ports answer to '{printable(target, 80)}'; one may be a device "
               "posing as the owner's port:" + listing + "\nAsk the owner which address is "
               "theirs (their Sharing tab shows it)")
    else:
        why = "Several ports answered:" + listing + "\nAsk the owner which one is theirs"
    if not sys.stdin.isatty():
        raise ConnectCommandFailed(why + ", then run: gguf-studio connect http://HOST:PORT")
    print(why + ".", flush=True)
    for i, port in enumerate(ports, 1):
        print(f"  {i}. {printable(port.name, 80)}  {printable(', '.join(port.urls))}",
              flush=True)
    while True:
        text = input(f"Which one (1-{len(ports)})? ").strip()
        if text.isdigit() and 1 <= int(text) <= len(ports):
            port = ports[int(text) - 1]
            return port.name, port.urls


async def _reachable(client: httpx.AsyncClient, urls: list[str]) -> str:
    for url in urls:
        try:
            await client.get(url + HEALTH, timeout=3)
        except httpx.HTTPError:
            continue
        return url
    raise ConnectCommandFailed("The port did not answer at " + ", ".join(urls) + ".")


async def _wait(client: httpx.AsyncClient, url: str, timeout: float,
                port_name: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wait = max(1, min(POLL_WAIT, int(deadline - time.monotonic())))
        try:
            answer = await client.get(url, params={"wait": wait})
        except httpx.TransportError as exc:
            raise ConnectCommandFailed(f"Lost {port_name} while waiting ({type(exc).__name__}); "
                                       "run gguf-studio connect again.") from None
        body = _json(answer, "The enrolment ended")
        if body.get("status") == "approved":
            return body
    raise ConnectCommandFailed(f"The owner did not answer within {timeout:g}s; run gguf-studio "
                               "connect again later.")


def _json(answer: httpx.Response, what: str) -> dict[str, Any]:
    try:
        body = answer.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ConnectCommandFailed(
            f"{what}: the answer is not GGUF Studio's (HTTP {answer.status_code}).")
    if answer.status_code >= 400:
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        raise ConnectCommandFailed(f"{what}: {message or answer.status_code}")
    return body


def _ends(answer: httpx.Response) -> tuple[str, str, int]:
    """This end of the connection `answer` came over: (this machine's address on it, the
    address it reached, that port number), as the socket says, not the answer."""
    stream = answer.extensions.get("network_stream")
    mine = stream.get_extra_info("client_addr") if stream is not None else None
    peer = stream.get_extra_info("server_addr") if stream is not None else None
    if not mine or not peer:
        raise ConnectCommandFailed("Could not read this connection's addresses, so the code "
                                   "could not be worked out; run gguf-studio connect again.")
    return normal_address(str(mine[0])), normal_address(str(peer[0])), int(peer[1])


def _say_code(name: str, ends: tuple[str, str, int], request: dict[str, Any]) -> None:
    """The code, worked out on this side, and where the port says it sees us from."""
    mine, peer, peer_port = ends
    code = enrolment_code(mine, peer, peer_port, name)
    print(f"Asked for a key named '{printable(name, 80)}', from {mine} to {peer}:{peer_port}.\n"
          f"Code: {code}\n"
          "  Read it to the owner with your name: their screen shows this code beside your "
          "request only when nothing stands between you and their port.", flush=True)
    seen = request.get("address")
    reached = request.get("port_address")
    if not isinstance(seen, str) or not isinstance(reached, list) or len(reached) != 2:
        print("The port did not say where it sees you from (an older GGUF Studio?). If the "
              "owner's code differs from yours, do not go on: ask for the port's address.",
              flush=True)
    elif (normal_address(seen), normal_address(str(reached[0])), str(reached[1])) == \
            (mine, peer, str(peer_port)) and request.get("code") == code:
        print(f"The port sees you as {mine}, as you are.", flush=True)
    else:
        print(f"Warning: the port sees you as {printable(seen, 60)}, reached at "
              f"{printable(reached[0], 60)}:{printable(reached[1], 10)}, but you are {mine} "
              f"talking to {peer}:{peer_port}. Something between you relays this connection "
              "(a NAT, a VPN, a tunnel, or a device posing as the port), and the owner's code "
              "will not be yours. Unless you expect that, stop (Ctrl-C) and ask the owner for "
              "the port's address: gguf-studio connect http://HOST:PORT", flush=True)
    print("Waiting for the owner to approve...", flush=True)


def _family(name: str) -> str:
    """`name` without the number a responder adds when another device holds the name
    (zeroconf "office-2", Avahi "office #2", Bonjour "office (2)"), case folded."""
    return _RENAMED.sub("", name.strip()).casefold()


_RENAMED = re.compile(r"(?:-\d+| #\d+| \(\d+\))$")


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
