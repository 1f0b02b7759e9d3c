"""The Requests tab's history across restarts: the request inspector's ring, written to the
user data dir when the service stops and read back when it starts.

A record holds names, numbers and codes, never a request's content
(`backend.port.request_log`); still it names the keys, their sessions (a client's own
name for a conversation) and when each asked what, so the file is private to the user
(0600 in a 0700 directory) and bounded as the ring is (its capacity, about 1 MB).  A file
that cannot be read is left aside and the history starts empty: it is a convenience,
never a reason not to start.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from backend.port.request_log import RequestLog, RequestRecord
from backend.private_files import make_private, write_private

__all__ = ["HISTORY_FILE", "load_history", "save_history"]

log = logging.getLogger("gguf_studio.service")

#: The history's file, in the user data dir.
HISTORY_FILE = "request-history.json"


def load_history(path: Path, into: RequestLog) -> int:
    """Put the records saved at `path` back in the ring `into` (oldest first, their ids
    kept); how many.  None saved, or unreadable: 0 (an unreadable file is logged)."""
    try:
        make_private(path)
        data = json.loads(path.read_text())
        records = [RequestRecord.from_dict(item) for item in data["records"]]
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("The request history could not be read (%s); starting without it.", exc)
        return 0
    into.restore(records)
    return len(records)


def save_history(path: Path, ring: RequestLog) -> None:
    """Write the ring's records to `path`, private to the user."""
    data = {"version": 1, "records": [record.to_dict() for record in ring.records()]}
    write_private(path, json.dumps(data, separators=(",", ":")).encode())
