"""`gguf-studio requests [--follow] [--json] [--port P | --url URL]`: the port's recent
requests, as its request inspector keeps them (`backend.port.request_log`).

It asks the running port's `/requests` with the saved owner's key (or
GGUF_STUDIO_API_KEY / GGUF_STUDIO_API_KEY_FILE) at the saved port on this machine, or at
`--url`.  `--follow` keeps asking, once a second, for the records after the last one
printed, until interrupted.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

from backend.errors import StudioError
from backend.port.request_log import RequestRecord

__all__ = ["add_requests_parser", "format_record", "requests_url"]

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
    where.add_argument("--url", metavar="URL", help="the port's address, e.g. http://host:8899")
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
        return str(args.url).rstrip("/") + "/requests"
    if host in _WILDCARDS:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{args.port or port}/requests"


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
    return "  ".join([
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
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
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
                          "key (the saved one, or GGUF_STUDIO_API_KEY).")
    if answer.status_code != 200:
        raise StudioError(f"The port answered {answer.status_code}: {_message(answer)}")
    page: dict[str, Any] = answer.json()
    return page


def _message(answer: Any) -> str:
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "no explanation."


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"
