"""A request's hint, without I/O: its session, scoped to its flow, and the digest of its
prompt's first blocks."""

from __future__ import annotations

import hashlib

from backend.admission.hint import (NO_HINT, PREFIX_BLOCK_CHARS, SESSION_NAME_CHARS,
                                    bounded_name, request_hint)


def chat(*contents: str, **fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": c} for c in contents], **fields}


def test_a_session_key_is_the_clients_prompt_cache_key_scoped_to_its_flow():
    body = chat("hi", prompt_cache_key="agent-7")
    assert request_hint("key alice", [], body).session == "key alice\nagent-7"
    assert request_hint("key bob", [], body).session != request_hint("key alice", [], body).session


def test_a_session_header_names_the_session_when_the_body_does_not():
    headers = [(b"Content-Type", b"application/json"), (b"X-Claude-Code-Session-Id", b"c1"),
               (b"x-session-id", b"s1")]
    assert request_hint("f", headers, chat("hi")).session == "f\ns1"  # the preferred header
    assert request_hint("f", headers[:2], chat("hi")).session == "f\nc1"
    assert request_hint("f", headers, chat("hi", prompt_cache_key="k")).session == "f\nk"
    codex = [(b"session_id", b"thread-9"), (b"conversation_id", b"thread-8")]
    assert request_hint("f", codex, chat("hi")).session == "f\nthread-9"
    # Codex CLI 0.171, as it was seen sending (with the same id as prompt_cache_key).
    assert request_hint("f", [(b"thread-id", b"t1"), (b"x-codex-window-id", b"t1:0")],
                        chat("hi")).session == "f\nt1"


def test_the_prefix_digest_names_the_blocks_two_prompts_share():
    system = "You are a coding agent. " * 200  # ~4.8 KB: more than the digest reads
    first = request_hint("f", [], {"system": "s", "messages": [{"role": "user", "content": "a" * 2_500}]})
    second = request_hint("f", [], {"system": "s", "messages": [{"role": "user", "content": "a" * 2_000 + "b" * 500}]})
    assert len(first.prefix) == 3  # 2,500 characters and a role mark: three blocks
    assert first.prefix[:1] == second.prefix[:1] and first.prefix[2] != second.prefix[2]
    long = request_hint("f", [], chat(system, "then"))
    assert len(long.prefix) == 4 and len(set(long.prefix)) == 4
    assert request_hint("f", [], chat(system, "other")).prefix == long.prefix  # beyond the digest
    assert request_hint("f", [], {"prompt": "x" * PREFIX_BLOCK_CHARS}).prefix != ()
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert request_hint("f", [], parts).prefix == request_hint("f", [], chat("hello")).prefix


def test_a_request_without_session_or_prompt_text_has_no_hint():
    assert request_hint("f", [], {"input": [{"type": "image"}]}) is NO_HINT
    assert request_hint("f", [], {}) is NO_HINT


def test_without_a_name_a_session_is_its_conversations_start_scoped_to_its_flow():
    head = {"role": "system", "content": "You are a coding agent. " * 300}  # one shared head
    first = [head, {"role": "user", "content": "fix the parser"}]
    other = [head, {"role": "user", "content": "write the docs"}]
    later = [*first, {"role": "assistant", "content": "done"}, {"role": "user", "content": "now test"}]
    session = request_hint("f", [], {"messages": first}).session
    assert session is not None and session.startswith("f\n")
    assert request_hint("f", [], {"messages": later}).session == session  # turn after turn
    assert request_hint("f", [], {"messages": other}).session != session  # the same head
    assert request_hint("g", [], {"messages": first}).session != session  # another flow


def test_the_prefix_digest_is_scoped_to_the_flow():
    body = chat("the same prompt, sent by two keys")
    assert request_hint("key alice", [], body).prefix != request_hint("key bob", [], body).prefix
    assert request_hint("key alice", [], body).flow == "key alice"


def test_a_hint_says_whether_the_engine_can_pin_its_request():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert request_hint("f", [], body).pinnable
    assert not request_hint("f", [], body, pinnable=False).pinnable
    assert not request_hint("f", [], {}, pinnable=False).pinnable  # no session: still not


def test_a_session_name_of_at_most_128_printable_characters_is_kept_as_given():
    name = "codex thread 019a-é/" + "x" * (SESSION_NAME_CHARS - 20)
    assert len(name) == SESSION_NAME_CHARS
    assert request_hint("f", [], chat("hi", prompt_cache_key=name)).session == f"f\n{name}"
    header = [(b"x-session-id", name.encode("latin-1"))]
    assert request_hint("f", header, chat("hi")).session == f"f\n{name}"


def test_a_longer_or_unprintable_session_name_is_kept_as_its_digest():
    huge = "s" * (30 << 20)  # 30 MiB: what a client once made the port keep four times
    session = request_hint("f", [], chat("hi", prompt_cache_key=huge)).session
    assert session == "f\nsha256:" + hashlib.sha256(huge.encode()).hexdigest()[:32]
    assert bounded_name(huge + "t") != bounded_name(huge)  # each long name its own
    assert bounded_name(huge) == bounded_name("s" * (30 << 20))  # the same in every process
    for unprintable in ("line\nbreak", "tab\there", "\x1b[31mred", "nul\x00"):
        bounded = bounded_name(unprintable)
        assert bounded.startswith("sha256:") and bounded.isprintable() and len(bounded) == 39
    # A header: its bytes' digest, a long one never decoded whole.
    long_header = b"h" * (16 << 10)
    assert request_hint("f", [(b"session_id", long_header)], chat("hi")).session == \
        "f\nsha256:" + hashlib.sha256(long_header).hexdigest()[:32]
    assert request_hint("f", [(b"session_id", b"\x85next-line")], chat("hi")).session == \
        "f\nsha256:" + hashlib.sha256(b"\x85next-line").hexdigest()[:32]
    # Scoped to the flow all the same.
    assert request_hint("g", [], chat("hi", prompt_cache_key=huge)).session != session
