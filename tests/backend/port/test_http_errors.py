"""What of llama-server's error texts reaches a client: the sentence, never an internal."""

from __future__ import annotations

import json
import time

import pytest

from backend.port.http_errors import error_body, scrub, upstream_error, upstream_stream_error


@pytest.mark.parametrize("text,kept,hidden", [
    ("cannot open /home/ann/My Models/llama 3.gguf: no such file",
     "cannot open <path>: no such file", ("home", "ann/", "My Models", "llama 3", ".gguf")),
    (r"cannot open C:\Users\Ann Lee\My Models\tiny q4.gguf, giving up",
     "cannot open <path>, giving up", ("Ann", "Models", "tiny", "q4")),
    ("could not reach gpu-box:8080 (connection refused)",
     "could not reach <address> (connection refused)", ("gpu-box", "8080")),
    ("proxy models.example.lan:11434 timed out",
     "proxy <address> timed out", ("models.example", "11434")),
])
def test_paths_with_spaces_and_named_hosts_are_hidden(text, kept, hidden):
    cleaned = scrub(text)
    assert cleaned == kept
    for needle in hidden:
        assert needle not in cleaned


def test_plain_sentences_with_numbers_and_slashes_are_kept():
    for text in ("request (9000 tokens) exceeds the available context size (4096 tokens)",
                 "12.5 tokens/s, and/or 3/4 of the slots",
                 "n_probs must be between 0 and 100"):
        assert scrub(text) == text


def test_scrubbing_a_hostile_message_stays_fast():
    hostile = ["a-" * 8000, "x." * 8000, "/a/" + "b " * 8000, "C:\\x\\" + "b " * 8000,
               "/a/b" + " c." * 5000, "a:" * 8000]
    started = time.perf_counter()
    for text in hostile:
        assert len(scrub(text * 4)) <= 2001
    assert time.perf_counter() - started < 1.0  # the earlier patterns took ~38 s here (quadratic)


def test_the_engines_param_is_scrubbed_too():
    body = json.dumps({"error": {"code": 400, "type": "invalid_request_error",
                                 "message": "bad grammar", "param": "/srv/secret dir/g.gbnf"}})
    error = upstream_error(400, body.encode())
    assert error.param == "<path>"
    body = json.dumps({"error": {"code": 400, "message": "bad", "param": "messages[0].content"}})
    assert upstream_error(400, body.encode()).param == "messages[0].content"


# --- llama-server's errors with numeric codes ------------------------------------------


def test_the_engines_context_exceeded_body_gets_the_openai_code():
    body = b'{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}'
    error = upstream_error(500, body)
    assert error.code == "context_length_exceeded"
    assert error_body(error)["error"]["code"] == "context_length_exceeded"


def test_an_in_stream_error_event_is_read_with_a_string_code():
    events = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
              b'data: {"error":{"code":500,"message":"Context size has been exceeded.",'
              b'"type":"server_error"}}\n\n')
    error = upstream_stream_error(events)
    assert error is not None and error.code == "context_length_exceeded"


def test_a_messages_error_event_is_read_too():
    events = b'event: error\ndata: {"code":503,"message":"Loading model","type":"unavailable_error"}\n\n'
    error = upstream_stream_error(events)
    assert error is not None and error.code == "unavailable_error" and error.status == 503


def test_content_that_mentions_errors_is_not_an_error_event():
    assert upstream_stream_error(
        b'data: {"choices":[{"delta":{"content":"event: error data: {\\"error\\"}"}}]}\n\n') is None


# --- the engine's 500s that are the client's mistakes -----------------------------------


@pytest.mark.parametrize("message,param,says", [
    ("[json.exception.type_error.302] type must be string, but is number", None,
     "a field has the wrong type"),
    ("[json.exception.parse_error.101] parse error at line 1, column 62: syntax error while "
     "parsing value - invalid literal; last read: 'NaN'", None, "a field has the wrong type"),
    ("Failed to parse messages: Missing 'role' in message: {\"content\":\"x\"}", "messages",
     "'messages'"),
    ("Failed to parse tools: Missing tool function: {}; tools = []", "tools", "'tools'"),
    ("image input is not supported - hint: if this is unexpected, you may need to provide "
     "the mmproj", None, "does not take images"),
    ("Unknown reasoning format: ", "reasoning_format", "Unknown reasoning format"),
    ('"prompt" must not be empty', "prompt", '"prompt" must not be empty'),
])
def test_an_engine_500_about_the_request_is_a_400_without_the_parsers_text(message, param, says):
    body = json.dumps({"error": {"code": 500, "message": message, "type": "server_error"}})
    error = upstream_error(500, body.encode())
    assert (error.status, error.type, error.code, error.param) == (
        400, "invalid_request_error", "invalid_request", param)
    assert says in str(error)
    assert "json.exception" not in str(error) and "Missing" not in str(error)
    assert "hint" not in str(error)
    # the same inside a stream
    streamed = upstream_stream_error(b"data: " + json.dumps({"error": {
        "code": 500, "message": message, "type": "server_error"}}).encode() + b"\n\n")
    assert streamed is not None and streamed.status == 400


def test_other_engine_500s_stay_server_errors():
    body = b'{"error":{"code":500,"message":"failed to decode the batch","type":"server_error"}}'
    error = upstream_error(500, body)
    assert error.status == 500 and error.type == "server_error"


def test_the_json_librarys_tag_is_cut_from_an_engine_400():
    body = json.dumps({"error": {"code": 400, "type": "invalid_request_error", "message":
                                 "Field 'temperature': [json.exception.type_error.302] type "
                                 "must be number, but is array"}})
    error = upstream_error(400, body.encode())
    assert str(error) == "Field 'temperature': type must be number, but is array"
