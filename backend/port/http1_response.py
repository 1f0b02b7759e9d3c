"""The answers of the gateway's upstream leg, read sans-I/O, in h11's style.

`ResponseParser` takes the bytes of one answer (`feed`, `feed_eof`) and gives its events
(`ResponseHead`, body `bytes`, `EndOfMessage`).  Strict (RFC 9112): status and header
lines, hex-only chunk sizes, the CRLF after chunk data, a single `chunked` as the only
Transfer-Encoding, one digits-only Content-Length; interim 1xx heads are checked and
skipped.  Anything else raises `MalformedAnswer`, after the events of the bytes before;
a connection that ends before the answer does, `ConnectionLost`.

The connections that feed it are `backend.port.upstream_http`'s.  Its strictness is
measured against aiohttp's llhttp by `bench/strictness.py` (see bench/README.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from backend.port.upstream_errors import ConnectionLost, MalformedAnswer

__all__ = ["EndOfMessage", "Event", "Headers", "ResponseHead", "ResponseParser"]

#: The largest head accepted (status line and header fields).
MAX_HEAD = 64 * 1024
#: The largest chunk size accepted (a bigger one is a malformed or hostile answer).
MAX_CHUNK = 1 << 62
#: The longest chunk-size or trailer line accepted.
MAX_CHUNK_LINE = 1024

# RFC 9112: status-line = HTTP-version SP 3DIGIT SP [reason-phrase]; the SP before an
# empty reason is often left out, and accepted.  field-line = token ":" OWS value OWS.
# (No regex with nested repetition here: those backtrack quadratically on hostile input.)
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9][0-9])(?: [\t\x20-\x7e\x80-\xff]*)?")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_FIELD_TEXT = re.compile(rb"[^\t\x20-\x7e\x80-\xff]")
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_CRLF = b"\r\n"

# Where a parser is in its answer.
_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _SIZED, _UNTIL_CLOSE, _DONE = range(8)


# --- events ------------------------------------------------------------------------------


class Headers(Mapping[str, str]):
    """An answer's header fields; names are case-insensitive, repeated ones joined by ", "."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields  # lower-case names

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"Headers({self._fields!r})"


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The final (non-1xx) status line and header fields of an answer."""

    status: int
    headers: Headers


@dataclass(frozen=True, slots=True)
class EndOfMessage:
    """The answer is complete.  `keep_alive`: the connection may carry the next request
    (False after `Connection: close`, HTTP/1.0, a body ended by the close, or bytes
    after the answer's end)."""

    keep_alive: bool


#: Body bytes come as `bytes` (transfer coding removed), not wrapped like h11's `Data`:
#: an object per relayed chunk costs about a microsecond here, against ~5 µs of the
#: port's whole CPU per chunk at saturation (bench/README.md).
Event: TypeAlias = ResponseHead | bytes | EndOfMessage


# --- the parser --------------------------------------------------------------------------


class ResponseParser:
    """The bytes of one HTTP/1.1 answer in, its events out; no I/O.

    `feed(data)` gives the events `data` completes, in order: one `ResponseHead`, body
    `bytes`, one `EndOfMessage`; bytes that break HTTP/1.1 raise `MalformedAnswer` once
    the events before them are taken.  The parser moves on as the events are taken:
    take them all before feeding more.  `feed_eof()` says that the connection ended.
    One parser per answer (the client never pipelines)."""

    def __init__(self) -> None:
        self._state = _HEAD
        self._rest = b""  # bytes of an unfinished head, chunk-size or trailer line
        self._scanned = 0  # how far into `_rest` no head end was found
        self._left = 0  # bytes of the body, of the chunk, or of its CRLF still to come
        self._keep_alive = True

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> Iterator[Event]:
        if self._rest:
            data = self._rest + data
            self._rest = b""
        end = len(data)
        pos = 0
        state = self._state
        if state == _HEAD:
            found = self._final_head(data)
            if found is None:
                return
            head, pos = found
            yield head
            state = self._state
            if state == _DONE:
                yield EndOfMessage(self._keep_alive and pos == end)
                return
        elif state == _DONE:
            raise MalformedAnswer("The upstream sent bytes after its answer.")
        left = self._left
        try:
            while pos < end:
                if state == _CHUNK_DATA or state == _SIZED:
                    take = left if left <= end - pos else end - pos
                    piece = data if take == end else data[pos:pos + take]
                    pos += take
                    left -= take
                    if left:
                        yield piece
                    elif state == _CHUNK_DATA:
                        state, left = _CHUNK_CRLF, 2
                        yield piece
                    else:
                        state = _DONE
                        yield piece
                        yield EndOfMessage(self._keep_alive and pos == end)
                        break
                elif state == _CHUNK_CRLF:  # the CRLF that ends a chunk's data
                    take = left if left <= end - pos else end - pos
                    if data[pos:pos + take] != _CRLF[2 - left:2 - left + take]:
                        raise MalformedAnswer("The upstream sent a chunk without its CRLF.")
                    pos += take
                    left -= take
                    if not left:
                        state = _CHUNK_SIZE
                elif state == _CHUNK_SIZE:
                    eol = data.find(b"\r\n", pos)
                    if eol < 0:
                        _check_line_length(end - pos)
                        break
                    # chunk-size [BWS ";" chunk-ext]: hex digits only (int() would also
                    # take "0x10", "+10", " 10" and "1_0")
                    digits = data[pos:eol]
                    if b";" in digits:
                        digits = digits.split(b";", 1)[0].rstrip(b" \t")
                    if not digits or digits.strip(_HEX_DIGITS):
                        raise MalformedAnswer("The upstream sent a malformed chunk size.")
                    left = int(digits, 16)
                    if left > MAX_CHUNK:
                        raise MalformedAnswer("The upstream sent a malformed chunk size.")
                    pos = eol + 2
                    state = _CHUNK_DATA if left else _TRAILER
                elif state == _TRAILER:
                    eol = data.find(b"\r\n", pos)
                    if eol < 0:
                        _check_line_length(end - pos)
                        break
                    line = data[pos:eol]
                    pos = eol + 2
                    if line and _field(line) is None:
                        raise MalformedAnswer("The upstream sent a malformed trailer.")
                    if not line:
                        state = _DONE
                        yield EndOfMessage(self._keep_alive and pos == end)
                        break
                else:  # _UNTIL_CLOSE
                    piece = data if pos == 0 else data[pos:]
                    pos = end
                    yield piece
        finally:
            self._state = state
            self._left = left
            if state != _DONE and pos < end:
                self._rest = data[pos:]

    def feed_eof(self) -> list[Event]:
        """The connection ended: the end of a body delimited by it, else `ConnectionLost`
        (no event once the answer is complete)."""
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            return [EndOfMessage(False)]
        if self._state != _DONE:
            raise ConnectionLost("The upstream closed the connection.")
        return []

    # --- the head ------------------------------------------------------------------------

    def _final_head(self, data: bytes) -> tuple[ResponseHead, int] | None:
        """The final head in `data` and where its blank line ends, interim 1xx heads
        before it checked and skipped; None while it has not all come (kept for later)."""
        pos = 0
        scanned, self._scanned = self._scanned, 0
        while True:
            end = data.find(b"\r\n\r\n", max(pos, scanned))
            if end < 0:
                if len(data) - pos > MAX_HEAD:
                    raise MalformedAnswer("The upstream sent an oversized header.")
                self._rest = data[pos:]
                self._scanned = max(len(self._rest) - 3, 0)
                return None
            status, fields, version, lengths = _parse_head(data[pos:end])
            pos = end + 4
            if status >= 200:
                head = ResponseHead(status, Headers(fields))
                self._frame(head, version, lengths)
                return head, pos

    def _frame(self, head: ResponseHead, version: bytes, lengths: int) -> None:
        """How the body after `head` ends (and whether the connection stays open)."""
        transfer = head.headers.get("transfer-encoding")
        if transfer is not None:
            # Only `chunked`, once: no coding was asked for (Accept-Encoding: identity),
            # and any other list leaves the body's end unknown.
            codings = [token.strip().lower() for token in transfer.split(",")]
            if codings != ["chunked"] or lengths:
                raise MalformedAnswer("The upstream sent an unsupported Transfer-Encoding.")
            self._state = _CHUNK_SIZE
        elif lengths:
            length = head.headers["content-length"]
            if lengths > 1 or not length.isdigit() or not length.isascii() or len(length) > 18:
                raise MalformedAnswer("The upstream sent a malformed Content-Length.")
            self._left = int(length)
            self._state = _SIZED if self._left else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self._keep_alive = False
        if head.status in (204, 304):  # no body, whatever the framing fields say
            self._state = _DONE
        connection = head.headers.get("connection", "").lower()
        if "close" in connection or (version == b"0" and "keep-alive" not in connection):
            self._keep_alive = False


# --- helpers -----------------------------------------------------------------------------


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bytes, int]:
    """One head (status line and field lines, no blank line), strictly: its status, its
    fields (lower-case names), its HTTP minor version (b"0" or b"1") and how many
    Content-Length fields it had."""
    lines = head.split(b"\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise MalformedAnswer("The upstream sent a malformed status line.")
    status = int(status_line.group(2))
    if status == 101:  # never asked for: the connection is not HTTP any more
        raise MalformedAnswer("The upstream switched protocols unasked.")
    fields: dict[str, str] = {}
    lengths = 0
    for line in lines[1:]:
        field = _field(line)
        if field is None:  # no colon, a space before it, a folded line, a control byte
            raise MalformedAnswer("The upstream sent a malformed header line.")
        name, value = field
        if name == "content-length":
            lengths += 1
        if name in fields:
            value = fields[name] + ", " + value
        fields[name] = value
    return status, fields, status_line.group(1), lengths


def _field(line: bytes) -> tuple[str, str] | None:
    """(lower-case name, value) of a header line, or None if it is malformed."""
    name, colon, value = line.partition(b":")
    if not colon or _TOKEN.fullmatch(name) is None or _NOT_FIELD_TEXT.search(value):
        return None
    return name.lower().decode("ascii"), value.strip(b" \t").decode("latin-1")


def _check_line_length(length: int) -> None:
    """An unfinished chunk-size or trailer line may not grow past MAX_CHUNK_LINE."""
    if length > MAX_CHUNK_LINE:
        raise MalformedAnswer("The upstream sent a malformed chunk.")
