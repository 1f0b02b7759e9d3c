"""`gguf-studio keys add|edit|revoke|list|requests|approve|refuse`: named API keys from
the command line.  `requests`, `approve` and `refuse` answer teammates who asked a running
port for a key (`gguf-studio connect`; backend.keys.enrolments): the port mints the key.

The keys' form, wording and table are shared with the window (`backend.app.sharing.key_table`);
the store applies changes to a running port live (`backend.keys.key_store`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from backend.errors import StudioError
from backend.settings import Settings

if TYPE_CHECKING:
    from backend.keys.usage import KeyUsage
    from backend.keys.enrolments import SharedRequest
    from backend.keys.key_store import KeyRecord

__all__ = ["add_key_parsers"]


def add_key_parsers(sub: Any) -> None:
    """`gguf-studio keys add|edit|revoke|list` on the command line's subparsers."""
    keys = sub.add_parser("keys", help="named API keys: one per person or agent, with limits")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="make a key and print its secret (shown this once)")
    edit = keys_sub.add_parser("edit", help="change a key's limits (the others stay)")
    approve = keys_sub.add_parser("approve", help="approve a teammate's request (gguf-studio "
                                  "connect) by its code: the running port makes the key, with "
                                  "these limits, when their connect collects it")
    refuse = keys_sub.add_parser("refuse", help="refuse a teammate's request, by its code")
    for command in (approve, refuse):
        command.add_argument("request", metavar="CODE",
                             help="the request's code, as keys requests lists it and the "
                             "teammate's screen shows it (or its NAME, with --code)")
        command.add_argument("--code", metavar="CODE",
                             help="the request's code, when NAME is given instead")
    for command in (add, edit):
        command.add_argument("name", metavar="NAME")
    for command in (add, edit, approve):
        command.add_argument("--models", metavar="A,B",
                             help="models the key may use, comma-separated; shell patterns "
                             "such as 'qwen*' allowed (default, or 'all': every model)")
        command.add_argument("--max-concurrent", metavar="N",
                             help="requests of this key running at once; more wait (0: no limit)")
        command.add_argument("--tokens-per-minute", metavar="N",
                             help="prompt plus output tokens per minute (0: no limit)")
        command.add_argument("--tokens-per-day", metavar="N",
                             help="prompt plus output tokens in any 24 hours (0: no limit)")
        command.add_argument("--priority", choices=("interactive", "normal", "batch"),
                             help="band: interactive before normal before batch (normal)")
        command.add_argument("--weight", metavar="W",
                             help="share of the engine against other keys of its band (1)")
        command.add_argument("--expires", metavar="DATE",
                             help="2026-03-31 (through that day), 2026-03-31T18:00, 30d, "
                             "12h, 2w, or never")
    add.set_defaults(run=_keys_add)
    edit.set_defaults(run=_keys_edit)
    approve.add_argument("--wait", type=float, default=10.0, metavar="S",
                         help="seconds to wait for the running port to make the key (10)")
    approve.set_defaults(run=_keys_approve)
    refuse.set_defaults(run=_keys_refuse)
    requests = keys_sub.add_parser("requests", help="teammates' requests for a key, waiting "
                                   "for you (name, address, code)")
    requests.add_argument("--json", action="store_true", help="machine-readable output")
    requests.set_defaults(run=_keys_requests)
    revoke = keys_sub.add_parser("revoke", help="refuse a key from now on (for good)")
    revoke.add_argument("name", metavar="NAME")
    revoke.set_defaults(run=_keys_revoke)
    listing = keys_sub.add_parser("list", help="keys with their limits and usage")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(run=_keys_list)


# The options of `keys add` and `keys edit`, by the KeyStore field each sets.
_KEY_OPTIONS = {"models": "models", "max_concurrent": "max_concurrent",
                "tokens_per_minute": "tokens_per_minute", "tokens_per_day": "tokens_per_day",
                "priority": "priority", "weight": "weight", "expires": "expires_at"}


def _keys_add(args: argparse.Namespace) -> int:
    from backend.app.sharing.key_table import describe_key
    from backend.keys.key_store import KeyStore

    record, secret = KeyStore().add(args.name, **_key_changes(args))
    # The secret alone on stdout (so `keys add NAME > file` keeps just it); the rest on
    # stderr.  This is the only place it is ever shown.
    print(secret, flush=True)
    print(f"Key {record.name!r} made: {describe_key(record)}.\n"
          "This is the only time its secret is shown (GGUF Studio keeps only a hash of it): "
          "give it to the person or agent as their API key.", file=sys.stderr)
    return 0


def _keys_edit(args: argparse.Namespace) -> int:
    from backend.app.sharing.key_table import describe_key
    from backend.keys.key_store import KeyStore

    changes = _key_changes(args)
    if not changes:
        raise StudioError("Nothing to change: give at least one of --models, --max-concurrent, "
                          "--tokens-per-minute, --tokens-per-day, --priority, --weight, "
                          "--expires.")
    record = KeyStore().edit(args.name, **changes)
    print(f"Key {record.name!r}: {describe_key(record)}.")
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    from backend.keys.expiry import describe_time
    from backend.keys.key_store import KeyStore

    store = KeyStore()
    before = next((r for r in store.records() if r.name.casefold() == args.name.casefold()),
                  None)
    record = store.revoke(args.name)
    assert record.revoked_at is not None
    if before is not None and before.revoked_at is not None:
        print(f"Key {record.name!r} was already revoked on {describe_time(record.revoked_at)}.")
    else:
        print(f"Key {record.name!r} revoked: its requests get 401 from now on, also those "
              "waiting, and its running ones end (a running port sees this within a "
              "second).")
    return 0


def _keys_requests(args: argparse.Namespace) -> int:
    import time

    from backend.keys.enrolments import EnrolmentFile, enrolments_path
    from backend.keys.expiry import describe_time

    requests = EnrolmentFile(enrolments_path()).requests()
    if args.json:
        print(json.dumps([r.__dict__ for r in requests], indent=2))
        return 0
    if not requests:
        print("No requests are waiting (teammates ask with: gguf-studio connect).",
              file=sys.stderr)
        return 0
    now = time.time()
    rows = [("NAME", "ADDRESS", "CODE", "ASKED", "EXPIRES IN")]
    rows += [(r.name, r.address, r.code, describe_time(r.requested_at),
              f"{max(0, int(r.expires_at - now)) // 60} min") for r in requests]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print("Check the code with the person, then: gguf-studio keys approve CODE [limits] "
          "or keys refuse CODE.", file=sys.stderr)
    return 0


def _keys_approve(args: argparse.Namespace) -> int:
    changes = _key_changes(args)
    if "models" in changes:
        changes["models"] = list(changes["models"])
    request, collected = _decide(args, "approve", changes)
    if collected:
        print(f"Key {request.name!r} made and sent to {request.address} (code "
              f"{request.code}).")
    else:
        from backend.keys.expiry import describe_time

        print(f"Request {request.name!r} from {request.address} (code {request.code}) "
              f"approved: the key is made when their gguf-studio connect collects it, which "
              f"it does while it waits; if it does not by {describe_time(request.expires_at)}, "
              "no key is made.")
    return 0


def _keys_refuse(args: argparse.Namespace) -> int:
    request, _ = _decide(args, "refuse", {})
    print(f"Request {request.name!r} from {request.address} (code {request.code}) refused; "
          "no key was made.")
    return 0


def _decide(args: argparse.Namespace, action: str, limits: dict[str, Any]
            ) -> "tuple[SharedRequest, bool]":
    """Write the decision on the request the owner named by its code for the running
    port, and wait until it took it; for an approval, also (within the wait) until the
    requester collected the key.  The request, and whether it was collected."""
    import time

    from backend.keys.enrolment_code import as_code
    from backend.keys.enrolments import EnrolmentFile, enrolments_path

    name = args.request if args.code is not None else None
    given = args.code if args.code is not None else args.request
    code = as_code(given)
    if code is None:
        raise StudioError(f"{given!r} is not a request's code (three letters or digits, a "
                          "dash, three more: gguf-studio keys requests lists them). Give the "
                          f"code: keys {action} CODE, or keys {action} NAME --code CODE.")
    shared = EnrolmentFile(enrolments_path())
    request = shared.decide(code, action, limits, name=name)
    wait = getattr(args, "wait", 10.0)
    deadline = time.monotonic() + wait
    taken = False
    while time.monotonic() < deadline:
        results = {str(o.get("result")): o for o in shared.outcomes()
                   if o.get("code") == request.code
                   and o.get("requested_at") == request.requested_at}
        failed = results.get("failed")
        if failed is not None:
            raise StudioError(f"The port could not {action} {request.name!r}: "
                              f"{failed.get('error')}")
        if "collected" in results:
            return request, True
        if action == "refuse" and "refused" in results:
            return request, False
        taken = taken or "approved" in results
        time.sleep(0.1)
    if taken:
        return request, False
    raise StudioError(f"The decision on {request.name!r} is written, but no running port took "
                      f"it within {wait:g}s (is the port that received the request running?).")


def _keys_list(args: argparse.Namespace) -> int:
    import time

    from backend.keys.usage import UsageLedger, usage_path
    from backend.keys.key_store import OWNER, KeyStore

    records = KeyStore().records()
    if _owner_key_set():
        records.insert(0, OWNER)
    usage = UsageLedger.load(usage_path(), writer=False).snapshot()
    now = time.time()
    if args.json:
        print(json.dumps([_key_json(r, usage.get(r.name), now) for r in records], indent=2))
        return 0
    if not records:
        print("No keys yet: gguf-studio keys add NAME makes one.", file=sys.stderr)
        return 0
    rows: list[tuple[str, ...]] = [("NAME", "STATUS", "MODELS", "CONCUR", "TOK/MIN", "TOK/DAY", "PRIORITY", "WEIGHT",
             "EXPIRES", "REQUESTS", "TOKENS", "MEAN WAIT", "REFUSED", "LAST USED")]
    rows += [_key_row(r, usage.get(r.name), now) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _key_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line, as KeyStore values (absent ones left out);
    read as the window's key dialog reads its fields (backend.app.sharing.key_table)."""
    from backend.app.sharing.key_table import parse_limit, parse_models
    from backend.errors import KeyStoreError
    from backend.keys.expiry import parse_expiry

    changes: dict[str, Any] = {}
    for option, field in _KEY_OPTIONS.items():
        text = getattr(args, option)
        if text is None:
            continue
        if option == "models":
            changes[field] = parse_models(text)
        elif option == "expires":
            changes[field] = parse_expiry(text)
        elif option == "weight":
            try:
                changes[field] = float(text)
            except ValueError:
                raise KeyStoreError(f"The weight {text!r} is not a number.") from None
        elif option == "priority":
            changes[field] = text
        else:
            changes[field] = parse_limit(text, option.replace("_", " "))
    return changes


def _owner_key_set() -> bool:
    try:
        return bool(Settings.load().api_key)
    except StudioError:
        return False


def _key_row(record: "KeyRecord", usage: "KeyUsage | None", now: float) -> tuple[str, ...]:
    from backend.keys.expiry import describe_time

    def number(value: int | None) -> str:
        return f"{value:,}" if value else "-"

    wait = usage.mean_wait if usage else None
    refused = sum(usage.refusals.values()) if usage else 0
    return (record.name, record.status(now), ",".join(record.models) or "all",
            number(record.max_concurrent), number(record.tokens_per_minute),
            number(record.tokens_per_day), str(record.priority), f"{record.weight:g}",
            describe_time(record.expires_at) if record.expires_at else "never",
            number(usage.requests if usage else 0), number(usage.total_tokens if usage else 0),
            f"{wait:.2f}s" if wait is not None else "-", number(refused),
            describe_time(usage.last_used) if usage and usage.last_used else "never")


def _key_json(record: "KeyRecord", usage: "KeyUsage | None", now: float) -> dict[str, Any]:
    from datetime import datetime, timezone

    def iso(when: float | None) -> str | None:
        return None if when is None else \
            datetime.fromtimestamp(when, timezone.utc).isoformat(timespec="seconds")

    entry: dict[str, Any] = {
        "name": record.name, "owner": record.is_owner, "status": record.status(now),
        "models": list(record.models), "max_concurrent": record.max_concurrent,
        "tokens_per_minute": record.tokens_per_minute, "tokens_per_day": record.tokens_per_day,
        "priority": str(record.priority), "weight": record.weight,
        "expires": iso(record.expires_at), "revoked": iso(record.revoked_at),
        "created": iso(record.created_at) if record.created_at else None,
    }
    if usage is None:
        entry["usage"] = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                          "wait_seconds": 0.0, "waits": 0, "mean_wait": None,
                          "refusals": {}, "last_used": None}
    else:
        entry["usage"] = {**usage.to_json(), "mean_wait": usage.mean_wait,
                          "last_used": iso(usage.last_used)}
    return entry
