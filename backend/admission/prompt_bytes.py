"""A prompt's size as its request's body shows it, without asking the engine: the part of
the byte bound (`backend.admission.prompt_tokens`) that reads the body.

`prompt_size`: the body's bytes and what a template may render larger than them (each tool
call's arguments re-indented), None when it holds an image; `indented_bytes`: JSON at the
largest size a template renders it; `images_in`: the images a body holds and their payloads'
bytes; `split_prompts`: a completions prompt's texts and the tokens it gives as ids;
`compact_json`: a value's JSON without spaces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["IMAGE_TOKENS", "compact_json", "images_in", "indented_bytes", "prompt_size",
           "split_prompts"]

#: Tokens counted per image when the engine cannot count (the engine counts them
#: exactly through its vision projector otherwise).  Fixed-size encoders use 256
#: (Gemma 3) to 576 (LLaVA 1.5); tiled and dynamic ones up to 2,880 (LLaVA-NeXT) or a
#: few thousand (Qwen2-VL at llama.cpp's default pixel limits).
IMAGE_TOKENS = 4096

_IMAGE_PARTS = {"image_url", "input_image", "image"}
#: Tool calls' arguments strings up to this many characters have their indented size
#: kept (`_kept_arguments_bytes`); longer ones are measured each time.
_ARGUMENTS_KEPT = 4096
#: Characters of arguments strings whose sizes are kept, at most (and 64 more for each
#: string's own memory): every call of every conversation in flight, 64 agents of a few
#: hundred calls each, in a few MB.
_ARGUMENTS_KEPT_CHARS = 8 << 20


def prompt_size(body: Mapping[str, Any], body_bytes: int) -> int | None:
    """The body's bytes and what its tool calls may render beyond them (re-indented
    arguments): the part of the byte bound a conversation grows by, turn after turn
    (`continued_turn.Continued`).  None with images: their bytes say nothing."""
    allowance = _tool_call_allowance(body)
    return None if allowance is None else body_bytes + allowance


def indented_bytes(value: Any) -> int:
    """Bytes of `value` as the largest JSON a template renders of it: indented by 4,
    non-ASCII escaped (`\\uXXXX`, 6 bytes for at most 4 in UTF-8).

    That is `len(json.dumps(value, indent=4))`, which json writes with its pure-Python
    encoder (and a reference cycle of closures per call, left to the garbage collector);
    here the C encoder writes it on one line with the same separators and escapes, and
    the line breaks and indents are counted: each item of a non-empty array or object
    at depth d (the value's own items at 1) comes after a line break and 4 × d spaces,
    and its closing bracket after one and 4 × (d - 1); an empty one is `[]` or `{}`
    either way."""
    size = len(json.dumps(value, separators=(",", ": ")))
    stack = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if children:
            size += len(children) * (1 + 4 * depth) + 4 * depth - 3
            stack.extend((child, depth + 1) for child in children
                         if isinstance(child, _CONTAINERS))
    return size


def images_in(body: Mapping[str, Any]) -> tuple[int, int]:
    """(images, bytes of their payloads) in messages, `input` items and `system`."""
    count = payload = 0
    stack: list[Any] = [body.get("messages"), body.get("input"), body.get("system")]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if _is_image(item):
                count += 1
                payload += len(compact_json(item).encode())
            else:
                stack.append(item.get("content"))
    return count, payload


def split_prompts(prompt: Any) -> tuple[list[str], int]:
    """(texts to tokenize, tokens already given as ids) of a completions prompt."""
    if isinstance(prompt, str):
        return [prompt], 0
    if not isinstance(prompt, list):
        return [], 0
    texts: list[str] = []
    exact = 0
    for part in prompt:
        if isinstance(part, str):
            texts.append(part)
        elif _whole(part):
            exact += 1
        elif isinstance(part, list):
            inner_texts, inner_exact = split_prompts(part)
            texts += inner_texts
            exact += inner_exact
        elif isinstance(part, dict):  # multimodal {"prompt_string": ..., "multimodal_data": [...]}
            text = part.get("prompt_string") or part.get("content")
            if isinstance(text, str):
                texts.append(text)
            data = part.get("multimodal_data")
            exact += IMAGE_TOKENS * (len(data) if isinstance(data, list) else 0)
    return texts, exact


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# --- helpers -----------------------------------------------------------------------------


_CONTAINERS = (dict, list, tuple)


def _arguments_bytes(arguments: str) -> int:
    """`indented_bytes` of a tool call's arguments string, parsed (of the string itself
    when it is no JSON)."""
    try:
        return indented_bytes(json.loads(arguments))
    except ValueError:
        return indented_bytes(arguments)


class _KeptSizes:
    """`_arguments_bytes` kept by the string: an agent resends its conversation's tool
    calls with every request, so each is measured once.  Strings of `_ARGUMENTS_KEPT_CHARS`
    in all; past it the memory starts over.  (Not an LRU of a number of strings: agents
    whose calls in flight outnumber it ask for them in turn, each found gone.)"""

    __slots__ = ("_sizes", "_chars")

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}
        self._chars = 0

    def __call__(self, arguments: str) -> int:
        size = self._sizes.get(arguments)
        if size is None:
            size = _arguments_bytes(arguments)
            self._chars += len(arguments) + 64
            if self._chars > _ARGUMENTS_KEPT_CHARS:
                self._sizes.clear()
                self._chars = len(arguments) + 64
            self._sizes[arguments] = size
        return size


_kept_arguments_bytes = _KeptSizes()


def _tool_call_allowance(body: Mapping[str, Any]) -> int | None:
    """Indented bytes of the arguments of every tool call in `body` (chat `tool_calls`,
    Responses `function_call` items, messages `tool_use` blocks): a template may render
    them parsed and re-indented, larger than the string the body holds.  None when the
    body holds an image (in its messages, `input` items or `system`): one walk of a
    conversation for both, once per request.  A list's items are walked in place and
    a string content is not pushed (most of a conversation): the walk is per request."""
    total = 0
    stack: list[Any] = [body.get("messages"), body.get("input"), body.get("system")]
    while stack:
        items = stack.pop()
        if not isinstance(items, list):
            if not isinstance(items, dict):
                continue
            items = (items,)
        for item in items:
            if not isinstance(item, dict):
                if isinstance(item, list):
                    stack.append(item)
                continue
            kind = item.get("type")
            if isinstance(kind, str) and kind in _IMAGE_PARTS:  # any other: not an image
                return None
            arguments = item.get("arguments")
            if arguments is None:
                function = item.get("function")
                if isinstance(function, dict):
                    arguments = function.get("arguments")
            if isinstance(arguments, str):
                total += (_kept_arguments_bytes(arguments) if len(arguments) <= _ARGUMENTS_KEPT
                          else _arguments_bytes(arguments))
            elif arguments is not None:
                total += indented_bytes(arguments)
            if kind == "tool_use":
                total += indented_bytes(item.get("input"))
            calls = item.get("tool_calls")
            if calls is not None:
                stack.append(calls)
            content = item.get("content")
            if content is not None and not isinstance(content, str):
                stack.append(content)
    return total


def _is_image(item: Mapping[str, Any]) -> bool:
    """An image part (its type a string naming one; a field the port does not check may
    hold anything, a list included, which names none)."""
    kind = item.get("type")
    return isinstance(kind, str) and kind in _IMAGE_PARTS


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
