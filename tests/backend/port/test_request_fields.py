"""The client's mistakes are 400s that name the field, decided by the port before the
engine sees them (the engine would answer many of them with a 500 and its parser's text);
what clients really send passes untouched.

Through the gateway harness's port, with the fake upstream behind it: every refusal here
happens before any upstream call.  The real engine's side (what it would have answered)
is the fuzz's business (tests/backend/test_gateway_fuzz.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.port.request_fields import MAX_EMBEDDING_INPUTS
from tests.backend.gateway_harness import CHAT, RESPONSES, assert_clean_error

COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
EMBEDDINGS = "/v1/embeddings"


def user(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": content, **extra}


TOOL = {"type": "function", "function": {"name": "read", "description": "Read a file.",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}

#: (route, body, the field the error names)
WRONG_TYPES = [
    (CHAT, {"messages": [user(), "hi"]}, "messages[1]"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [user(role=7)]}, "messages[0].role"),
    (CHAT, {"messages": [user(42)]}, "messages[0].content"),
    (CHAT, {"messages": [user({"text": "hi"})]}, "messages[0].content"),
    (CHAT, {"messages": [user([{"text": "hi"}])]}, "messages[0].content[0].type"),
    (CHAT, {"messages": [user([{"type": "text", "text": 5}])]}, "messages[0].content[0].text"),
    (CHAT, {"messages": [user([{"type": "text"}])]}, "messages[0].content[0].text"),
    (CHAT, {"messages": [user([{"type": "image_url", "image_url": 3}])]},
     "messages[0].content[0].image_url"),
    (CHAT, {"messages": [user(name=None)]}, "messages[0].name"),
    (CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
     "messages[0].tool_call_id"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
     "messages[0].tool_calls[0].function"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [dict(CALL, type="custom")]}]},
     "messages[0].tool_calls[0].type"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "read"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    (CHAT, {"messages": [user()], "model": ["m"]}, "model"),
    (CHAT, {"messages": [user()], "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": [user()], "top_p": True}, "top_p"),
    (CHAT, {"messages": [user()], "seed": "1"}, "seed"),
    (CHAT, {"messages": [user()], "stop": 5}, "stop"),
    (CHAT, {"messages": [user()], "stop": ["a", 1]}, "stop[1]"),
    (CHAT, {"messages": [user()], "stream_options": True}, "stream_options"),
    (CHAT, {"messages": [user()], "response_format": "json"}, "response_format"),
    (CHAT, {"messages": [user()], "reasoning_format": 1}, "reasoning_format"),
    (CHAT, {"messages": [user()], "tool_choice": 1}, "tool_choice"),
    (CHAT, {"messages": [user()], "tools": TOOL}, "tools"),
    (CHAT, {"messages": [user()], "tools": [{"function": TOOL["function"]}]}, "tools[0].type"),
    (CHAT, {"messages": [user()], "tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, {"messages": [user()], "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    (CHAT, {"messages": [user()], "tools": [
        {"type": "function", "function": {"name": "x", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    (CHAT, {"messages": [user()], "tools": [
        {"type": "function", "function": {"name": "x", "description": None}}]},
     "tools[0].function.description"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": ["ok", {"x": 1}]}, "prompt[1]"),
    (COMPLETIONS, {"prompt": "x", "stop": {"a": 1}}, "stop"),
    (COMPLETIONS, {"prompt": "x", "temperature": [1]}, "temperature"),
    (EMBEDDINGS, {}, "input"),
    (EMBEDDINGS, {"input": True}, "input"),
    (EMBEDDINGS, {"input": [[1.5]]}, "input[0]"),
    (RESPONSES, {}, "input"),
    (RESPONSES, {"input": 3}, "input"),
    (RESPONSES, {"input": ["hi"]}, "input[0]"),
    (RESPONSES, {"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text"),
    (RESPONSES, {"input": "x", "instructions": ["be nice"]}, "instructions"),
    (RESPONSES, {"input": "x", "tools": [{"type": "function", "name": 1}]}, "tools[0].name"),
    (MESSAGES, {"max_tokens": 5, "messages": "hi"}, "messages"),
    (MESSAGES, {"max_tokens": 5, "messages": [user(3)]}, "messages[0].content"),
    (MESSAGES, {"max_tokens": 5, "messages": [user([{"type": 1}])]}, "messages[0].content[0].type"),
    (MESSAGES, {"max_tokens": 5, "messages": [user()], "system": 1}, "system"),
    (MESSAGES, {"max_tokens": 5, "messages": [user()], "stop_sequences": "x"}, "stop_sequences"),
    (MESSAGES, {"max_tokens": 5, "messages": [user()], "tools": [{"name": "x", "input_schema": 1}]},
     "tools[0].input_schema"),
]


@pytest.mark.parametrize("route,body,param", WRONG_TYPES,
                         ids=[f"{route} {param}" for route, _, param in WRONG_TYPES])
async def test_a_field_of_the_wrong_shape_is_a_400_naming_it(gw, fake, route, body, param):
    response = await gw.client.post(route, json=body)
    error = assert_clean_error(response, 400, "invalid_request", gw)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert f"'{param}'" in error["message"]
    assert fake.requests == []


#: (route, body, the field the error names): what would pick the engine's slot, or run
#: several generations (one slot each) under the request's one admission ticket.
ONE_GENERATION = [
    (CHAT, {"messages": [user()], "id_slot": 0}, "id_slot"),
    (COMPLETIONS, {"prompt": "x", "id_slot": 1}, "id_slot"),
    (RESPONSES, {"input": "x", "id_slot": 0}, "id_slot"),
    (MESSAGES, {"max_tokens": 5, "messages": [user()], "id_slot": 0}, "id_slot"),
    (CHAT, {"messages": [user()], "n": 2}, "n"),
    (COMPLETIONS, {"prompt": "x", "n": 4}, "n"),
    (RESPONSES, {"input": "x", "n_cmpl": 2}, "n_cmpl"),
    (COMPLETIONS, {"prompt": ["a", "b", "c", "d"]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3, 4]]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", [1, 2], {"prompt_string": "b"}]}, "prompt"),
    (EMBEDDINGS, {"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
]


@pytest.mark.parametrize("route,body,param", ONE_GENERATION,
                         ids=[f"{route} {param} {i}" for i, (route, _, param) in enumerate(ONE_GENERATION)])
async def test_a_request_is_one_generation_in_a_slot_the_server_chooses(gw, fake, route, body,
                                                                       param):
    response = await gw.client.post(route, json=body)
    error = assert_clean_error(response, 400, "invalid_request", gw)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert f"'{param}'" in error["message"]
    assert fake.requests == []


NON_STANDARD_JSON = {
    "NaN": b'{"messages": [], "temperature": NaN}',
    "Infinity": b'{"messages": [], "temperature": Infinity}',
    "-Infinity": b'{"messages": [], "top_p": -Infinity}',
    "a float beyond a double": b'{"messages": [], "temperature": 1e400}',
    "an integer beyond a double": b'{"messages": [], "seed": 1' + b"0" * 400 + b"}",
    "half a surrogate pair": b'{"messages": [{"role": "user", "content": "\\ud800x"}]}',
    "a lone low surrogate as a key": b'{"messages": [], "\\udc00": 1}',
    "UTF-16": '{"messages": []}'.encode("utf-16"),
    "Latin-1": '{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1"),
}


@pytest.mark.parametrize("raw", list(NON_STANDARD_JSON.values()), ids=list(NON_STANDARD_JSON))
async def test_json_that_only_python_reads_is_a_400(gw, fake, raw):
    response = await gw.client.post(CHAT, content=raw,
                                    headers={"content-type": "application/json"})
    error = assert_clean_error(response, 400, "invalid_request", gw)
    assert error["message"].startswith("The request body is not")
    assert fake.requests == []


async def test_escaped_characters_beyond_the_basic_plane_are_fine(gw, fake):
    raw = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}]}'
    response = await gw.client.post(CHAT, content=raw,
                                    headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert fake.received(CHAT)[0]["messages"][0]["content"] == "\U0001F600 \\ud800"


#: What real clients send (shapes of the OpenAI SDK, Codex, OpenCode, Claude Code, curl).
GOOD = [
    (CHAT, {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        user([{"type": "text", "text": "look"},
              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "file text"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm"}],
        "tools": [TOOL], "tool_choice": "auto", "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0.2, "top_p": 1,
        "max_tokens": None, "stop": None, "seed": 7, "parallel_tool_calls": False,
        "response_format": {"type": "text"}, "user": "u", "logit_bias": {"50256": -100}}),
    (CHAT, {"messages": [user()], "stop": ["\n"], "tool_choice": {
        "type": "function", "function": {"name": "read"}}, "n_predict": 5, "top_k": 40}),
    (COMPLETIONS, {"prompt": "Once", "stop": "\n", "max_tokens": 3}),
    (COMPLETIONS, {"prompt": [1, 2, "three", 4]}),
    (COMPLETIONS, {"prompt": [{"prompt_string": "b"}]}),
    (COMPLETIONS, {"prompt": [[1, 2]], "n": 1, "id_slot": -1}),
    (EMBEDDINGS, {"input": ["a", "b"], "model": "m"}),
    (EMBEDDINGS, {"input": ["x"] * MAX_EMBEDDING_INPUTS}),
    (EMBEDDINGS, {"input": [1, 2, 3]}),
    (RESPONSES, {"model": "m", "instructions": "Be brief.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "text"}],
        "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}},
                  {"type": "web_search"}],
        "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}}, "store": False}),
    (MESSAGES, {"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
                "messages": [user([{"type": "text", "text": "hi"}]),
                             {"role": "assistant", "content": [
                                 {"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
                             user([{"type": "tool_result", "tool_use_id": "t1",
                                    "content": [{"type": "text", "text": "x"}]}])],
                "tools": [{"name": "read", "description": "d", "input_schema": {"type": "object"}}],
                "stop_sequences": ["END"], "thinking": {"type": "disabled"}}),
]


@pytest.mark.parametrize("route,body", GOOD, ids=[f"{route} {i}" for i, (route, _) in enumerate(GOOD)])
async def test_what_real_clients_send_passes_untouched(gw, fake, route, body):
    """Every field as the client sent it; the port adds only its own ask for the engine's
    progress on a streamed prompt (`backend.port.prefill`; not on the Anthropic wire,
    whose events never carry it)."""
    response = await gw.client.post(route, json=body)
    assert response.status_code == 200, response.text
    sent = json.loads(json.dumps(body))
    if body.get("stream") and route != MESSAGES:
        sent["return_progress"] = True
    assert fake.received(route) == [sent]


@pytest.mark.parametrize("route,body", [
    (CHAT, {"messages": [user(type=["text"]), user([{"type": "text", "text": "x",
                                                     "cache": {"type": ["ephemeral"]}}])]}),
    (MESSAGES, {"max_tokens": 5, "messages": [user(type={"kind": "message"})]}),
], ids=["chat", "messages"])
async def test_a_field_the_port_does_not_check_reaches_the_engine_in_any_shape(gw, fake, route,
                                                                              body):
    """A field the engine does not read with a fixed type is the engine's to judge
    (`request_fields`' docstring): whatever its shape, a list or an object where a string
    is usual, the port forwards it untouched, never a 500 of its own."""
    response = await gw.client.post(route, json=body)
    assert response.status_code == 200, response.text
    assert fake.received(route) == [body]
