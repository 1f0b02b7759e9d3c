"""The parser of the upstream leg's answers, sans-I/O, so tested by feeding bytes, split
anywhere (hypothesis picks the split points; derandomized, so every run tries the same
cases).  The answers are `tests/malformed_upstream.py`'s, which the client's tests send
from a raw socket (`test_upstream_http.py`).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.port.http1_response import EndOfMessage, Event, ResponseHead, ResponseParser
from backend.port.upstream_errors import ConnectionLost, MalformedAnswer
from tests.malformed_upstream import (DATA16, GOOD_STREAM, INTERIM, MALFORMED, WELL_FORMED, chunked,
                                      good_json)

CASES = settings(derandomize=True, deadline=None, max_examples=150)
GOOD_BODY = (b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n'
             b"data: [DONE]\n\n")
#: Well-formed answers and the body each one carries.
READABLE = {
    "stream": (GOOD_STREAM, GOOD_BODY),
    **{f"{name}, then a stream": (interim + GOOD_STREAM, GOOD_BODY)
       for name, interim in INTERIM.items()},
    "json": (good_json(b'{"a":1}'), b'{"a":1}'),
    "404 after a 100 Continue": (b"HTTP/1.1 100 Continue\r\n\r\n"
                                 b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nhello",
                                 b"hello"),
    **{name: (answer, DATA16 if b"chunked" in answer else b"hello")
       for name, answer in WELL_FORMED.items()},
}


def split_at(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    return [raw[a:b] for a, b in zip(points, points[1:])]


def parse(pieces: list[bytes]) -> list[Event]:
    """Every event of an answer fed in `pieces`, body bytes joined into one."""
    parser = ResponseParser()
    events: list[Event] = []
    for piece in pieces:
        for event in parser.feed(piece):
            if isinstance(event, bytes) and events and isinstance(events[-1], bytes):
                events[-1] += event
            else:
                events.append(event)
    return events


def body_of(events: list[Event]) -> bytes:
    return b"".join(e for e in events if isinstance(e, bytes))


cuts = st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=12)


# --- the parser ----------------------------------------------------------------------


@CASES
@given(name=st.sampled_from(sorted(READABLE)), cuts=cuts)
def test_well_formed_answers_read_the_same_however_the_bytes_are_split(name, cuts):
    raw, body = READABLE[name]
    events = parse(split_at(raw, cuts))
    assert isinstance(events[0], ResponseHead) and events[0].status in (200, 404)
    assert body_of(events) == body
    assert events[-1] == EndOfMessage(keep_alive=True)


@CASES
@given(name=st.sampled_from(sorted(MALFORMED)), cuts=cuts)
def test_malformed_answers_are_refused_however_the_bytes_are_split(name, cuts):
    with pytest.raises(MalformedAnswer):
        parse(split_at(MALFORMED[name], cuts))


@CASES
@given(chunks=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
       extension=st.sampled_from([b"", b";x=1", b" ;name", b"\t;a=b;c"]),
       upper=st.booleans(), cuts=cuts)
def test_chunked_bodies_are_decoded_whatever_their_chunks_and_splits(chunks, extension,
                                                                      upper, cuts):
    sizes = [(b"%X" if upper else b"%x") % len(chunk) for chunk in chunks]
    raw = chunked(*(size + extension + b"\r\n" + chunk + b"\r\n"
                    for size, chunk in zip(sizes, chunks)), b"0\r\nX-Trailer: 1\r\n\r\n")
    events = parse(split_at(raw, cuts))
    assert body_of(events) == b"".join(chunks)
    assert events[-1] == EndOfMessage(keep_alive=True)


@CASES
@given(cuts=cuts)
def test_what_came_before_a_fault_is_delivered_before_the_error(cuts):
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"3\r\nabc\r\n3\r\ndefX\n0\r\n\r\n")
    parser = ResponseParser()
    body = b""
    with pytest.raises(MalformedAnswer, match="CRLF"):
        for piece in split_at(raw, cuts):
            for event in parser.feed(piece):
                if isinstance(event, bytes):
                    body += event
    assert body == b"abcdef"


def test_the_head_says_status_and_headers_case_insensitively():
    head = parse([b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"X-A: 1\r\nx-a: 2\r\nContent-Length: 0\r\n\r\n"])[0]
    assert isinstance(head, ResponseHead) and head.status == 503
    assert head.headers.get("content-type") == "application/json"
    assert head.headers.get("Content-Type") == "application/json"
    assert head.headers["X-A"] == "1, 2" and head.headers.get("missing") is None


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nEXTRA",
], ids=["Connection close", "HTTP/1.0", "bytes after a sized body", "bytes after a chunked one"])
def test_an_answer_after_which_the_connection_cannot_be_reused_says_so(raw):
    events = parse([raw])
    assert body_of(events) == b"ok" and events[-1] == EndOfMessage(keep_alive=False)


def test_an_http10_answer_with_keep_alive_keeps_its_connection():
    events = parse([b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"])
    assert events[-1] == EndOfMessage(keep_alive=True)


def test_answers_without_a_body_end_at_their_head():
    for raw in (b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
                b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"):
        events = parse([raw])
        assert len(events) == 2 and events[-1] == EndOfMessage(keep_alive=True)


def test_a_body_delimited_by_the_close_ends_when_the_connection_does():
    parser = ResponseParser()
    events = list(parser.feed(b"HTTP/1.0 200 OK\r\n\r\nab")) + list(parser.feed(b"c"))
    assert body_of(events) == b"abc" and not parser.done
    assert parser.feed_eof() == [EndOfMessage(keep_alive=False)] and parser.done


@pytest.mark.parametrize("raw", [
    b"",
    b"HTTP/1.1 200 OK\r\nContent-Ty",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabc",
], ids=["nothing", "in the head", "mid-chunk", "between chunks", "short of its length"])
def test_a_connection_that_ends_before_the_answer_is_lost(raw):
    parser = ResponseParser()
    list(parser.feed(raw))
    with pytest.raises(ConnectionLost):
        parser.feed_eof()


def test_a_complete_answer_needs_nothing_from_the_end_of_the_connection():
    parser = ResponseParser()
    list(parser.feed(GOOD_STREAM))
    assert parser.done and parser.feed_eof() == []


def test_bytes_fed_after_the_end_are_refused():
    parser = ResponseParser()
    list(parser.feed(GOOD_STREAM))
    with pytest.raises(MalformedAnswer):
        list(parser.feed(b"HTTP/1.1 200 OK\r\n"))


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (70 * 1024),
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"a" * 2000,
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: " + b"a" * 2000,
], ids=["head", "chunk size line", "trailer line"])
def test_an_endless_head_or_line_is_refused_before_it_ends(raw):
    with pytest.raises(MalformedAnswer):
        parse(split_at(raw, [1000, 5000, 40000]))


def test_a_hostile_header_line_is_refused_without_backtracking():
    # 60 KB of blanks before a control byte: a backtracking regex took 64 s on this
    # machine (the event loop stalled for every stream); the check is linear.
    raw = b"HTTP/1.1 200 OK\r\nX-Pad:" + b" \t" * 30000 + b"\x01\r\n\r\n"
    started = time.perf_counter()
    with pytest.raises(MalformedAnswer):
        parse([raw])
    assert time.perf_counter() - started < 1.0


def test_a_head_that_arrives_a_byte_at_a_time_is_not_scanned_again_and_again():
    raw = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 60000 + b"\r\nContent-Length: 0\r\n\r\n"
    started = time.perf_counter()
    events = parse(split_at(raw, list(range(0, len(raw), 7))))
    assert events[-1] == EndOfMessage(keep_alive=True)
    assert time.perf_counter() - started < 5.0
