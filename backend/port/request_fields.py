"""The shapes of the fields llama-server reads from a gated request, checked before it is
forwarded.

llama-server answers a field of the wrong type with HTTP 500 and its JSON library's text
(`[json.exception.type_error.302] type must be string, but is number`), and a malformed
message, prompt or tool with a 500 too ("Failed to parse messages: ..."): the client's
mistake would look like the server's.  So the port checks the fields the engine reads
against the shapes the OpenAI and Anthropic APIs give them, and answers 400
`invalid_request_error` naming the field (`messages[2].content[0].text`).  Fields it does
not know are left to the engine; values of the right type are never judged (an unknown
role, an empty prompt: the engine says what it makes of them).

The port decides what runs on the engine's slots, so a request is one generation in
whichever slot is free: a client may not choose the slot (`id_slot`), ask for several
answers (`n`, `n_cmpl`: llama-server would run each in a slot of its own), or send several
prompts in one completions request (a list of prompts is one task per prompt).  Each
would run several generations, or aim at another key's slot, under one admission ticket;
each is a 400 naming the field.  An embeddings request may list up to `MAX_EMBEDDING_INPUTS`
inputs (OpenAI's own bound).

`check_fields(route, data)` runs on the parsed body (`backend.port.request_body.parse_body`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from backend.api_paths import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, RESPONSES
from backend.errors import InvalidRequest

__all__ = ["MAX_EMBEDDING_INPUTS", "check_fields"]

#: The most inputs one embeddings request may list (OpenAI's limit): each is a task of
#: the engine's, all under the request's one admission ticket.
MAX_EMBEDDING_INPUTS = 2048

# Kinds of JSON values, as a check and the words an error uses for it.
Kind = tuple[Callable[[Any], bool], str]
STRING: Kind = (lambda v: isinstance(v, str), "a string")
NUMBER: Kind = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
BOOLEAN: Kind = (lambda v: isinstance(v, bool), "true or false")
OBJECT: Kind = (lambda v: isinstance(v, dict), "an object")
ARRAY: Kind = (lambda v: isinstance(v, list), "a list")

#: Fields of every generating route that llama-server reads with a fixed type (sampling,
#: grammar, template options).  `null` is always allowed: it means "not given".
SAMPLING: dict[str, tuple[Kind, ...]] = {
    **{name: (NUMBER,) for name in (
        "temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty",
        "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "n", "n_probs",
        "top_logprobs", "mirostat", "mirostat_tau", "mirostat_eta", "dynatemp_range",
        "dynatemp_exponent", "xtc_probability", "xtc_threshold", "dry_multiplier",
        "dry_base", "dry_allowed_length", "dry_penalty_last_n", "n_keep", "n_indent",
        "min_keep", "id_slot")},
    **{name: (BOOLEAN,) for name in (
        "cache_prompt", "ignore_eos", "parallel_tool_calls", "add_generation_prompt",
        "return_tokens", "post_sampling_probs", "timings_per_token", "return_progress")},
    **{name: (STRING,) for name in ("grammar", "reasoning_format", "user")},
    **{name: (OBJECT,) for name in ("stream_options", "response_format", "json_schema",
                                    "chat_template_kwargs", "metadata")},
    "tool_choice": (STRING, OBJECT),
    "logit_bias": (OBJECT, ARRAY),
}


def check_fields(route: str, data: Mapping[str, Any]) -> None:
    """InvalidRequest naming the first field of `data` whose shape the engine cannot use."""
    if route != EMBEDDINGS:
        # The body's fields, not every known one: a request sends a few of them.
        for name, value in data.items():
            kinds = SAMPLING.get(name)
            if kinds is not None:
                _check(value, name, *kinds)
        _one_generation(data)
    _ROUTES[route](data)


# --- routes ------------------------------------------------------------------------------


def _chat(data: Mapping[str, Any]) -> None:
    _check(data.get("reasoning_effort"), "reasoning_effort", STRING)
    _stop(data.get("stop"), "stop")
    _messages(data.get("messages"), "messages", _chat_content)
    _chat_tools(data.get("tools"), "tools")


def _completions(data: Mapping[str, Any]) -> None:
    _stop(data.get("stop"), "stop")
    if "prompt" not in data or data["prompt"] is None:
        raise InvalidRequest("'prompt' is required.", param="prompt")
    _prompts(data["prompt"], "prompt")
    count = _prompt_count(data["prompt"])
    if count > 1:
        raise InvalidRequest(
            f"'prompt' lists {count} prompts; this server answers one prompt per request "
            "(send one request for each).", param="prompt")


def _embeddings(data: Mapping[str, Any]) -> None:
    name = "input" if "input" in data else "content"
    if data.get(name) is None:
        raise InvalidRequest("'input' is required.", param="input")
    _prompts(data[name], name)
    count = _prompt_count(data[name])
    if count > MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(
            f"'{name}' lists {count} inputs; at most {MAX_EMBEDDING_INPUTS} are taken in one "
            "request.", param=name)


def _responses(data: Mapping[str, Any]) -> None:
    _check(data.get("instructions"), "instructions", STRING)
    _check(data.get("reasoning"), "reasoning", OBJECT)
    _check(data.get("text"), "text", OBJECT)
    _stop(data.get("stop"), "stop")
    items = data.get("input")
    if items is None:
        raise InvalidRequest("'input' is required.", param="input")
    _check(items, "input", STRING, ARRAY)
    if isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                _check(item, f"input[{i}]", OBJECT, required=True)
            for name in _ITEM_STRINGS:
                value = item.get(name)
                if value is not None and not isinstance(value, str):
                    _check(value, f"input[{i}].{name}", STRING)
            for name in ("content", "output"):
                value = item.get(name)
                if isinstance(value, list):
                    _parts(value, f"input[{i}].{name}")
                elif value is not None and not isinstance(value, str):
                    _check(value, f"input[{i}].{name}", STRING, ARRAY)
    tools = data.get("tools")
    _check(tools, "tools", ARRAY)
    for i, tool in enumerate(tools or ()):
        _check(tool, f"tools[{i}]", OBJECT, required=True)
        _check(tool.get("type"), f"tools[{i}].type", STRING)
        _check(tool.get("name"), f"tools[{i}].name", STRING)
        _check(tool.get("description"), f"tools[{i}].description", STRING)
        _check(tool.get("parameters"), f"tools[{i}].parameters", OBJECT)


def _messages_route(data: Mapping[str, Any]) -> None:
    """Anthropic's messages API."""
    system = data.get("system")
    _check(system, "system", STRING, ARRAY)
    if isinstance(system, list):
        _parts(system, "system")
    _check(data.get("stop_sequences"), "stop_sequences", ARRAY)
    for i, stop in enumerate(data.get("stop_sequences") or ()):
        _check(stop, f"stop_sequences[{i}]", STRING, required=True)
    _check(data.get("thinking"), "thinking", OBJECT)
    _messages(data.get("messages"), "messages", _anthropic_content)
    tools = data.get("tools")
    _check(tools, "tools", ARRAY)
    for i, tool in enumerate(tools or ()):
        _check(tool, f"tools[{i}]", OBJECT, required=True)
        _check(tool.get("name"), f"tools[{i}].name", STRING)
        _check(tool.get("description"), f"tools[{i}].description", STRING)
        _check(tool.get("input_schema"), f"tools[{i}].input_schema", OBJECT)


_ROUTES: dict[str, Callable[[Mapping[str, Any]], None]] = {
    CHAT: _chat, COMPLETIONS: _completions, RESPONSES: _responses,
    MESSAGES: _messages_route, EMBEDDINGS: _embeddings,
}


# --- parts -------------------------------------------------------------------------------
#
# A conversation has hundreds of these parts, and each is checked on every request: a
# check's quick pass is written inline (a string is a string), and `_check` only words
# the error, with the field's path, which is made only then.

#: A Responses input item's fields that are strings when given.
_ITEM_STRINGS = ("role", "type", "call_id", "name", "arguments", "output_text")
#: A chat or messages message's fields that are strings when present (null is refused).
_MESSAGE_STRINGS = ("name", "tool_call_id", "reasoning_content")
#: A content block's fields that are strings, and objects, when given.
_PART_STRINGS = ("type", "text", "thinking", "id", "name", "tool_use_id", "image_url", "refusal")
_PART_OBJECTS = ("source", "input")


def _one_generation(data: Mapping[str, Any]) -> None:
    """Refuse the fields that pick the engine's slot or run several generations."""
    slot = data.get("id_slot")
    if slot is not None and slot != -1:
        raise InvalidRequest("'id_slot' is not accepted: the server chooses the slot of "
                             "each request.", param="id_slot")
    for name in ("n", "n_cmpl"):
        count = data.get(name)
        if count is not None and count != 1:
            raise InvalidRequest(f"'{name}' must be 1: this server generates one answer per "
                                 "request (send one request for each answer).", param=name)


def _prompt_count(prompt: Any) -> int:
    """How many tasks llama-server makes of a prompt: a list holding no token id is a
    list of prompts, anything else one prompt (tokenize_input_prompts)."""
    if isinstance(prompt, list) and not any(_token_id(v) for v in prompt):
        return len(prompt)
    return 1



def _messages(messages: Any, where: str,
              content: Callable[[Any, str], None]) -> None:
    if not isinstance(messages, list):
        raise InvalidRequest(f"'{where}' must be a list of messages.", param=where)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            _check(message, f"{where}[{i}]", OBJECT, required=True)
        if "role" not in message:
            raise InvalidRequest(f"'{where}[{i}].role' is required.", param=f"{where}[{i}].role")
        if not isinstance(message["role"], str):
            _check(message["role"], f"{where}[{i}].role", STRING, required=True)
        for name in _MESSAGE_STRINGS:
            # present means a string: llama-server reads a null here as a type error
            value = message.get(name)
            if not isinstance(value, str) and (value is not None or name in message):
                _check(value, f"{where}[{i}].{name}", STRING, required=name in message)
        value = message.get("content")
        if value is not None and not isinstance(value, str):
            content(value, f"{where}[{i}].content")
        calls = message.get("tool_calls")
        if calls is not None:
            _tool_calls(calls, f"{where}[{i}].tool_calls")


def _chat_content(content: Any, where: str) -> None:
    _check(content, where, STRING, ARRAY)
    if isinstance(content, list):
        for i, part in enumerate(content):
            if (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str) and part.get("image_url") is None
                    and part.get("input_audio") is None):
                continue  # a text part, the common one: each check below passes
            at = f"{where}[{i}]"
            _check(part, at, OBJECT, required=True)
            if "type" not in part:
                raise InvalidRequest(f"'{at}.type' is required.", param=f"{at}.type")
            _check(part["type"], f"{at}.type", STRING, required=True)
            if part["type"] == "text" or "text" in part:
                _check(part.get("text"), f"{at}.text", STRING, required=part["type"] == "text")
            image = part.get("image_url")
            _check(image, f"{at}.image_url", OBJECT, STRING)
            if isinstance(image, dict):
                _check(image.get("url"), f"{at}.image_url.url", STRING)
            _check(part.get("input_audio"), f"{at}.input_audio", OBJECT)


def _anthropic_content(content: Any, where: str) -> None:
    _check(content, where, STRING, ARRAY)
    if isinstance(content, list):
        _parts(content, where)


def _parts(parts: list[Any], where: str) -> None:
    """Content blocks of the Responses and messages APIs: objects with a string type and
    string texts."""
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            _check(part, f"{where}[{i}]", OBJECT, required=True)
        for name in _PART_STRINGS:
            value = part.get(name)
            if value is not None and not isinstance(value, str):
                _check(value, f"{where}[{i}].{name}", STRING)
        for name in _PART_OBJECTS:
            value = part.get(name)
            if value is not None and not isinstance(value, dict):
                _check(value, f"{where}[{i}].{name}", OBJECT)
        inner = part.get("content")
        if isinstance(inner, list):
            _parts(inner, f"{where}[{i}].content")
        elif inner is not None and not isinstance(inner, str):
            _check(inner, f"{where}[{i}].content", STRING, ARRAY)


def _tool_calls(calls: Any, where: str) -> None:
    """An assistant message's tool calls, as llama-server requires them."""
    _check(calls, where, ARRAY)
    for i, call in enumerate(calls or ()):
        if isinstance(call, dict) and call.get("type") == "function":
            function = call.get("function")
            if (isinstance(function, dict) and isinstance(function.get("name"), str)
                    and isinstance(function.get("arguments"), (str, dict))
                    and (isinstance(call.get("id"), str) or "id" not in call)):
                continue  # each check below passes
        at = f"{where}[{i}]"
        _check(call, at, OBJECT, required=True)
        _check(call.get("id"), f"{at}.id", STRING, required="id" in call)
        _function(call, at, "arguments")
        _check(call["function"]["arguments"], f"{at}.function.arguments", STRING, OBJECT,
               required=True)


def _chat_tools(tools: Any, where: str) -> None:
    _check(tools, where, ARRAY)
    for i, tool in enumerate(tools or ()):
        at = f"{where}[{i}]"
        _check(tool, at, OBJECT, required=True)
        _function(tool, at)
        function = tool["function"]
        _check(function.get("description"), f"{at}.function.description", STRING,
               required="description" in function)
        _check(function.get("parameters"), f"{at}.function.parameters", OBJECT)


def _function(item: Mapping[str, Any], where: str, *required: str) -> None:
    """`{"type": "function", "function": {"name": ..., ...}}` (a tool or a tool call)."""
    if item.get("type") != "function":
        raise InvalidRequest(f"'{where}.type' must be \"function\" (the only kind of tool "
                             "this server runs).", param=f"{where}.type")
    function: Any = item.get("function")
    _check(function, f"{where}.function", OBJECT, required=True)
    _check(function.get("name"), f"{where}.function.name", STRING, required=True)
    for name in required:
        if name not in function:
            raise InvalidRequest(f"'{where}.function.{name}' is required.",
                                 param=f"{where}.function.{name}")


def _stop(stop: Any, where: str) -> None:
    _check(stop, where, STRING, ARRAY)
    if isinstance(stop, list):
        for i, value in enumerate(stop):
            _check(value, f"{where}[{i}]", STRING, required=True)


def _prompts(prompt: Any, where: str) -> None:
    """A completions prompt or embeddings input: a string, token ids, a list mixing
    both, an object with a `prompt_string`, or a list of those."""
    if isinstance(prompt, str) or _tokens_or_texts(prompt):
        return
    if not isinstance(prompt, list):
        _subprompt(prompt, where)
        return
    if not prompt:
        raise InvalidRequest(f"'{where}' must not be empty.", param=where)
    for i, item in enumerate(prompt):
        _subprompt(item, f"{where}[{i}]")


def _subprompt(item: Any, where: str) -> None:
    if isinstance(item, str) or _tokens_or_texts(item):
        return
    if isinstance(item, dict) and isinstance(item.get("prompt_string"), str):
        data = item.get("multimodal_data")
        _check(data, f"{where}.multimodal_data", ARRAY)
        for i, value in enumerate(data or ()):
            _check(value, f"{where}.multimodal_data[{i}]", STRING, required=True)
        return
    raise InvalidRequest(
        f"'{where}' must be a string, a list of token ids (0 to 2^31 - 1) and strings, or "
        "an object with a 'prompt_string'.", param=where)


def _tokens_or_texts(value: Any) -> bool:
    """A non-empty list of token ids and strings."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, str) or _token_id(v) for v in value)


def _token_id(value: Any) -> bool:
    """A whole number that fits llama.cpp's token type (a 32-bit signed integer)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _check(value: Any, where: str, *kinds: Kind, required: bool = False) -> None:
    """InvalidRequest unless `value` is of one of `kinds` (or None, when not required)."""
    if value is None and not required:
        return
    for test, _ in kinds:
        if test(value):
            return
    names = " or ".join(name for _, name in kinds)
    raise InvalidRequest(f"'{where}' must be {names}.", param=where)
