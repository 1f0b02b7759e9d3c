"""A prompt's size as its body shows it, without the engine: each tool call's arguments
count at the size a template may re-indent them to."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.admission.prompt_bytes import prompt_size


#: Tool calls' arguments as bodies hold them: JSON (nested, empty, non-ASCII, long) or not.
ARGUMENT_VALUES: list[Any] = [
    {"path": "src/a.py"}, {}, [], {"a": [], "b": {}, "c": [[], [{}]]}, 12, "x" * 5000,
    {"deep": {"x": [1, 2.5, None, True, {"y": ["Tröpfchen", "水", "🙂", "\"\\\n"]}]}}]
ARGUMENTS = [json.dumps(value) for value in ARGUMENT_VALUES]
ARGUMENTS += ["plain text", "{not json"]


@pytest.mark.parametrize("text", ARGUMENTS)
def test_a_tool_calls_arguments_count_at_the_size_a_template_reindents_them_to(text):
    """What a template may render of a tool call's arguments is their JSON indented by 4
    with non-ASCII escaped (Jinja's `tojson(indent=4)` writes no more): each call adds
    exactly that to the body's size, the second time it is sent as the first."""
    try:
        rendered = json.dumps(json.loads(text), indent=4)
    except ValueError:
        rendered = json.dumps(text, indent=4)
    chat = {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}]}]}
    responses = {"input": [{"type": "function_call", "call_id": "c1", "name": "f",
                            "arguments": text}]}
    messages = {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": json.loads(rendered)}]}]}
    for body in (chat, responses, chat, messages):
        assert prompt_size(body, 100) == 100 + len(rendered)


def test_every_agents_tool_calls_count_in_full_however_many_agents_send_them_in_turn():
    """64 agents whose conversations hold 40 tool calls each, every call its own, each
    agent sending its whole conversation in turn, three times over: each request's size
    is its bytes and each call's arguments re-indented, every time (the sizes are kept
    per arguments string; more strings than any count of them must not change one)."""
    def conversation(agent: int) -> tuple[dict[str, Any], int]:
        messages: list[dict[str, Any]] = []
        extra = 0
        for turn in range(40):
            arguments = json.dumps({"path": f"src/{agent}/{turn}.py", "lines": [turn, agent]})
            extra += len(json.dumps(json.loads(arguments), indent=4))
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{turn}", "type": "function",
                 "function": {"name": "read", "arguments": arguments}}]})
        return {"messages": messages}, extra

    agents = [conversation(agent) for agent in range(64)]
    for _ in range(3):
        for body, extra in agents:
            assert prompt_size(body, 1000) == 1000 + extra
