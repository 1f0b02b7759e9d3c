"""`gguf-studio requests [--follow] [--json] [--port P | --url URL] [--api-key-file F]`:
the port's recent requests, as its request inspector keeps them
(`backend.port.request_log`).

It asks the running port's `/requests` at the saved port on this machine (or `--port`)
with the saved owner's key (or GGUF_STUDIO_API_KEY / GGUF_STUDIO_API_KEY_FILE).  Another
address (`--url`) gets only the key given for it: `--api-key-file`, else the key typed
at the prompt; the owner's key of this machine goes to this machine's port alone.
`--follow` keeps asking, once a second, for the records after the last one printed,
until interrupted.  What the port answers is printed through `printable`.
"""

from __future__ import annotations

import argparse
import getpass
import ipaddress
import json
import sys
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from backend.addresses import is_loopback, lan_addresses
from backend.api_keys import read_api_key_file
from backend.api_paths import REQUESTS
from backend.errors import StudioError
from backend.models.hf_cache import printable
from backend.port.request_log import RequestRecord

__all__ = ["add_requests_parser", "format_record", "requests_key", "requests_url"]

#: Seconds between two asks of `--follow`.
FOLLOW_INTERVAL = 1.0
#: Records the first ask prints (the ring keeps more).
FIRST_PAGE = 50
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def add_requests_parser(sub: Any) -> None:
    """`gguf-studio requests` on the command line's subparsers."""
    requests = sub.add_parser(
        "requests", help="the port's recent requests: who, where, how long each waited and why")
    where = requests.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, metavar="P",
                       help="the port on this machine (default: the saved one)")
    where.add_argument("--url", metavar="URL", help="the port's address, e.g. http://host:8899 "
                       "(another machine's: its owner key is asked for, never this one's sent)")
    requests.add_argument("--api-key-file", metavar="FILE",
                          help="a file holding the owner key of the port asked (default: the "
                          "saved key for this machine's port, asked for at another address)")
    requests.add_argument("--follow", "-f", action="store_true",
                          help="keep printing new requests as they end")
    requests.add_argument("--json", action="store_true",
                          help="one JSON object per request (JSON lines)")
    requests.add_argument("--limit", type=int, default=FIRST_PAGE, metavar="N",
                          help=f"how many of the latest to print first ({FIRST_PAGE}; 0: all)")
    requests.set_defaults(run=_requests)


def requests_url(args: argparse.Namespace, host: str, port: int) -> str:
    """The `/requests` address: `--url`, else this machine's saved (or `--port`) port."""
    if args.url:
        return str(args.url).rstrip("/") + REQUESTS
    if host in _WILDCARDS:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{args.port or port}/requests"


def requests_key(args: argparse.Namespace, port: int, saved_key: str) -> str:
    """The key to send: `--api-key-file`'s; else the saved owner key when the address is
    this machine's port (the saved one, or `--port`); else the key the user types."""
    if args.api_key_file:
        return read_api_key_file(args.api_key_file)
    if not args.url or _is_this_port(str(args.url), port):
        return saved_key
    if not sys.stdin.isatty():
        raise StudioError(f"{printable(args.url)} is not this machine's port: its owner key is "
                          "not the one saved here. Give it with --api-key-file FILE.")
    return getpass.getpass(f"Owner key of the port at {printable(args.url)}: ").strip()


def format_record(record: RequestRecord) -> str:
    """One line of the table: when, who, where, the outcome, the wait and the figures."""
    clock = time.strftime("%H:%M:%S", time.localtime(record.time))
    outcome = str(record.status) + (f" {record.error}" if record.error else "")
    wait = _seconds(record.wait)
    if record.wait_reason:
        wait += f" {record.wait_reason}"
        if record.waited_behind:
            wait += f" behind {record.waited_behind}"
    prompt = "-" if record.prompt_tokens is None else str(record.prompt_tokens)
    if record.cached_tokens is not None:
        prompt += f" ({record.cached_tokens} cached)"
    where = record.engine or "-"
    if record.slot is not None:
        where += f"#{record.slot}"
    # Every field is the port's answer, maybe another machine's: nothing may drive the terminal.
    return "  ".join(printable(field, 400) for field in [
        clock, f"{record.key:<12}", f"{record.model or '-':<20}", f"{where:<16}",
        f"{outcome:<8}", f"wait {wait}", f"prompt {prompt}",
        f"out {'-' if record.output_tokens is None else record.output_tokens}",
        f"ttft {_seconds(record.time_to_first_token)}",
        f"{'-' if record.tokens_per_second is None else f'{record.tokens_per_second:.1f}'} tok/s",
        f"gap {_seconds(record.longest_gap)}",
    ])


def _requests(args: argparse.Namespace) -> int:
    import httpx

    from backend.settings import Settings

    settings = Settings.load()
    url = requests_url(args, settings.host, settings.port)
    key = requests_key(args, settings.port, settings.api_key)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    show: Callable[[RequestRecord], str] = (
        (lambda r: json.dumps(r.to_dict())) if args.json else format_record)
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        after = 0
        limit = max(args.limit, 0)
        while True:
            page = _ask(client, url, headers, after, limit)
            for item in page["data"]:
                record = RequestRecord.from_dict(item)
                print(show(record), flush=True)
                after = max(after, record.id)
            after = max(after, int(page.get("last_id") or 0))
            if not args.follow:
                return 0
            limit = 0
            time.sleep(FOLLOW_INTERVAL)


def _ask(client: Any, url: str, headers: dict[str, str], after: int,
         limit: int) -> dict[str, Any]:
    import httpx

    try:
        answer = client.get(url, headers=headers, params={"after": after, "limit": limit})
    except httpx.HTTPError:
        raise StudioError(f"No GGUF Studio port answers at {url}. Is it running? "
                          "(--port P or --url URL to ask another.)") from None
    if answer.status_code in (401, 403):
        raise StudioError("The port refused the key: requests are shown with the owner's "
                          "key (the saved one, GGUF_STUDIO_API_KEY, or --api-key-file).")
    if answer.status_code != 200:
        raise StudioError(f"The port answered {answer.status_code}: {_message(answer)}")
    page: dict[str, Any] = answer.json()
    return page


def _message(answer: Any) -> str:
    try:
        return printable(answer.json()["error"]["message"], 400)
    except (ValueError, KeyError, TypeError):
        return "no explanation."


def _is_this_port(url: str, port: int) -> bool:
    """Whether `url` names this machine's saved port by an address of its own (a host
    name is not looked up: its answer could name any machine)."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        host, url_port = parts.hostname or "", parts.port or 80
    except ValueError:
        return False
    if url_port != port:
        return False
    if is_loopback(host):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return str(address) in lan_addresses()


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"
