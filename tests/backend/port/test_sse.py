"""The relay's byte handling, chunk by chunk: whole events only, one response id, and
error texts scrubbed of internals."""

from __future__ import annotations

import pytest

from backend.port.http_errors import scrub
import json

from backend.port.sse import (BrokenStream, EventFramer, ResponsesRewriter, event_ends,
                              find_prompt_cache, find_usage, without_cache_figures)



# --- the relay's byte handling, chunk by chunk ----------------------------------------------


def relay_through(chunks: list[bytes], our_id: str | None) -> tuple[list[bytes], ResponsesRewriter]:
    framer, rewriter = EventFramer(), ResponsesRewriter(our_id)
    sent = [rewriter.feed(framer.feed(chunk)) for chunk in chunks]
    sent.append(rewriter.feed(framer.finish()) + rewriter.flush())
    return sent, rewriter


UPSTREAM_HEAD = (b'event: response.created\ndata: {"type":"response.created","response":'
                 b'{"id":"resp_up1","object":"response","status":"in_progress"}}\n\n')
UPSTREAM_BODY = (b'event: response.in_progress\ndata: {"type":"response.in_progress","response":'
                 b'{"id":"resp_up1"}}\n\nevent: response.completed\ndata: {"type":"response.completed",'
                 b'"response":{"id":"resp_up1","status":"completed"}}\n\n')


@pytest.mark.parametrize("cut", [1, 7, 30, len(UPSTREAM_HEAD) - 1, len(UPSTREAM_HEAD) + 40,
                                 len(UPSTREAM_HEAD) + 75])
def test_the_upstream_id_is_replaced_wherever_the_chunks_are_cut(cut):
    stream_ = b": ping\n\n" + UPSTREAM_HEAD + UPSTREAM_BODY
    sent, rewriter = relay_through([stream_[:cut], stream_[cut:]], "resp_ours")
    out = b"".join(sent)
    assert rewriter.upstream_id == "resp_up1" and rewriter.client_id == "resp_ours"
    assert b"resp_up1" not in out and b"response.created" not in out
    assert out.startswith(b": ping\n\n")
    assert out.count(b'"id":"resp_ours"') == 2
    assert all(not chunk or chunk.endswith(b"\n\n") for chunk in sent), "whole events only"


def test_a_stream_nobody_waited_for_keeps_the_upstream_id():
    sent, rewriter = relay_through([UPSTREAM_HEAD + UPSTREAM_BODY], None)
    assert b"".join(sent) == UPSTREAM_HEAD + UPSTREAM_BODY
    assert rewriter.client_id == "resp_up1"


def test_a_stream_that_does_not_start_with_response_created_is_passed_on():
    error = b'data: {"error":{"code":500,"message":"x"}}\n\n'
    sent, rewriter = relay_through([error, UPSTREAM_BODY], "resp_ours")
    assert b"".join(sent) == error + UPSTREAM_BODY
    assert rewriter.client_id == "resp_ours"


def test_response_completed_reaches_the_client_only_with_the_streams_end():
    """Codex CLI hangs up once it has response.completed: the port sends it only after
    the upstream's end, having recorded the answer (else it took it for a client that
    left, and the Sessions tab missed the turn)."""
    delta = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
             b'"delta":"see\\nevent: response.completed\\n","item_id":"resp_up1"}\n\n')
    framer, rewriter = EventFramer(), ResponsesRewriter("resp_ours")
    sent = [rewriter.feed(framer.feed(chunk)) for chunk in (UPSTREAM_HEAD, delta, UPSTREAM_BODY)]
    assert sent[1] == delta.replace(b"resp_up1", b"resp_ours")  # text naming it is not it
    assert sent[2].endswith(b"\n\n") and b"response.in_progress" in sent[2]
    assert b"response.completed" not in sent[2]
    assert rewriter.feed(framer.feed(b": trailing comment\n\n")) == b""  # kept in order
    end = rewriter.feed(framer.finish()) + rewriter.flush()
    assert end.startswith(b"event: response.completed\n") and b'"id":"resp_ours"' in end
    assert end.endswith(b": trailing comment\n\n")


def test_the_framer_holds_partial_events_and_understands_crlf():
    framer = EventFramer()
    assert framer.feed(b"data: 1\n\ndata: 2") == b"data: 1\n\n"
    assert framer.feed(b"2\n") == b""
    assert framer.feed(b"\ndata: 3\r\n\r\n") == b"data: 22\n\ndata: 3\r\n\r\n"
    assert framer.feed(b"data: half") == b""
    framer.drop()  # the upstream died: the half event is never sent
    assert framer.finish() == b""


def test_a_stream_that_ends_or_runs_on_inside_an_event_is_broken():
    framer = EventFramer()
    assert framer.feed(b"data: 1\n\ndata: {\"cut") == b"data: 1\n\n"
    with pytest.raises(BrokenStream):
        framer.finish()  # the half event is not handed to the client
    framer = EventFramer()
    assert framer.feed(b"data: 1\n\n\r\n") == b"data: 1\n\n"
    assert framer.finish() == b"\r\n"  # a stray blank line is no event
    with pytest.raises(BrokenStream):  # not SSE at all: neither hoarded nor let through
        framer.feed(b"x" * (EventFramer.LIMIT + 1))


def test_event_ends_finds_whole_events_only():
    assert event_ends(b"data: 1\n\ndata: 2\r\n\r\ndata: 3") == [9, 20]
    assert event_ends(b"data: half") == []


def test_scrub_removes_internals_but_keeps_the_sentence():
    text = ("cannot open /home/ann/models/llama 3.gguf or C:\\Users\\ann\\m.gguf via "
            "http://127.0.0.1:8080/slots at 10.0.0.5:8080, [::1]:9000 and localhost:1234")
    cleaned = scrub(text)
    for needle in ("/home", "C:\\", "127.0.0.1", "10.0.0.5", "8080", "9000", "1234", "http"):
        assert needle not in cleaned
    assert cleaned.startswith("cannot open")
    assert scrub("request (9000 tokens) exceeds the available context size (4096 tokens)") == \
        "request (9000 tokens) exceeds the available context size (4096 tokens)"


# --- the prompt cache's figures ----------------------------------------------------------

# The shapes llama-server (the pinned build) gives its final events and bodies.
TIMINGS = {"cache_n": 11, "prompt_n": 3, "prompt_ms": 4.2, "predicted_n": 1, "predicted_ms": 1.5}
CHAT_FINAL = ("data: " + json.dumps({
    "choices": [{"finish_reason": "length", "index": 0, "delta": {}}], "object": "chat.completion.chunk",
    "usage": {"completion_tokens": 1, "prompt_tokens": 14, "total_tokens": 15,
              "prompt_tokens_details": {"cached_tokens": 11}},
    "timings": TIMINGS}) + "\n\ndata: [DONE]\n\n").encode()
RESPONSES_FINAL = ("event: response.completed\ndata: " + json.dumps({
    "type": "response.completed", "response": {"id": "resp_1", "usage": {
        "input_tokens": 14, "output_tokens": 1, "total_tokens": 15,
        "input_tokens_details": {"cached_tokens": 11}}}, "timings": TIMINGS}) + "\n\n").encode()
MESSAGES_FINAL = ("event: message_delta\ndata: " + json.dumps({
    "type": "message_delta", "delta": {"stop_reason": "max_tokens"},
    "usage": {"output_tokens": 1, "input_tokens": 3, "cache_read_input_tokens": 11},
    "timings": TIMINGS}) + "\n\n").encode()
PROGRESS = ("data: " + json.dumps({"choices": [{"delta": {"role": "assistant"}}],
                                   "prompt_progress": {"total": 14, "cache": 11, "processed": 14,
                                                       "time_ms": 3.0}}) + "\n\n").encode()


@pytest.mark.parametrize("events", [CHAT_FINAL, RESPONSES_FINAL, MESSAGES_FINAL, PROGRESS,
                                    CHAT_FINAL.replace(b"\n", b"\r\n")])
def test_a_streams_cache_figures_are_left_out_and_the_rest_kept(events):
    out = without_cache_figures(events, stream=True)
    assert b"timings" not in out and b"prompt_progress" not in out and b"11" not in out
    assert out.count(b"\n") == events.count(b"\n")  # the same events, framed the same way
    assert [out[:end].count(b"data:") for end in event_ends(out)] == \
        [events[:end].count(b"data:") for end in event_ends(events)]
    usage = find_usage(out)
    assert usage is None or usage == find_usage(events)  # the same prompt and answer
    if b"cache_read_input_tokens" in events:  # Anthropic's input_tokens: all of the prompt
        assert b'"input_tokens":14' in out


def test_a_body_without_the_cache_comes_back_unchanged_and_a_non_streamed_one_is_scrubbed():
    content = b'data: {"choices":[{"delta":{"content":"cache me"}}]}\n\n'
    assert without_cache_figures(content, stream=True) is content  # named, but no figure
    plain = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    assert without_cache_figures(plain, stream=True) is plain
    body = json.dumps({"usage": {"prompt_tokens": 14, "prompt_tokens_details": {"cached_tokens": 11}},
                       "timings": TIMINGS, "tokens_cached": 11}).encode()
    scrubbed = json.loads(without_cache_figures(body, stream=False))
    assert scrubbed == {"usage": {"prompt_tokens": 14, "prompt_tokens_details": {"cached_tokens": 0}},
                        "tokens_cached": 0}


def test_an_answers_cached_and_computed_prompt_tokens_are_read_from_its_last_figures():
    chat_tail = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
                 b'data: {"choices":[],"timings":{"cache_n":900,"prompt_n":120,'
                 b'"predicted_n":4}}\n\ndata: [DONE]\n\n')
    assert find_prompt_cache(chat_tail) == (900, 120)
    openai = b'{"usage":{"prompt_tokens":1000,"prompt_tokens_details":{"cached_tokens":768}}}'
    assert find_prompt_cache(openai) == (768, 232)
    responses = (b'event: response.completed\ndata: {"type":"response.completed","response":'
                 b'{"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":40}}}}\n\n')
    assert find_prompt_cache(responses) == (40, 10)
    anthropic = (b'event: message_delta\ndata: {"type":"message_delta","usage":'
                 b'{"input_tokens":30,"cache_read_input_tokens":700,"output_tokens":5}}\n\n')
    assert find_prompt_cache(anthropic) == (700, 30)
    assert find_prompt_cache(b'data: {"choices":[]}\n\ndata: [DONE]\n\n') is None
