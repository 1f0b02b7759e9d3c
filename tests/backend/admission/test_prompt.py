"""A prompt as the port reads it, without I/O: its parts and blocks, and whether one
request continues another."""

from __future__ import annotations

import json
from typing import Any

from backend.admission.hint import request_hint
from backend.admission.prompt import NO_BLOCKS, NO_PROMPT, prompt_blocks, read_prompt
from tests.backend.admission.chat_bodies import (AGENT, AGENT_NEXT, FIRST, HEAD, SECOND, TOOLS,
                                                 blocks_of, chat, user)


def test_anthropic_and_responses_bodies_have_blocks_too():
    messages = {"system": [{"type": "text", "text": HEAD}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                          {"type": "text", "text": "hello"}]}]}
    assert [p.kind for p in prompt_blocks(messages).parts] == [
        "system", "user", "reasoning", "assistant"]
    responses = {"instructions": HEAD, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "name": "run", "arguments": "{}", "call_id": "c1"}]}
    assert [p.kind for p in prompt_blocks(responses).parts] == ["system", "user", "tool"]


def test_a_turn_that_adds_messages_continues_the_last_but_one_that_rewrites_it_does_not():
    assert blocks_of(SECOND).continues(blocks_of(FIRST))
    assert blocks_of(AGENT_NEXT).continues(blocks_of(AGENT))
    assert not blocks_of(FIRST).continues(blocks_of(SECOND))  # shorter: not a continuation
    # An earlier message rewritten, the system prompt changed, tools sent, another field.
    rewritten = chat({**user("list the files"), "content": "list every file"},
                     {"role": "assistant", "content": "Here they are."}, user("open main.py"))
    assert not blocks_of(rewritten).continues(blocks_of(FIRST))
    assert not blocks_of(chat(user("list the files"), user("x"), system="Be brief.")).continues(
        blocks_of(FIRST))
    assert not blocks_of(chat(user("list the files"), user("x"), tools=TOOLS)).continues(
        blocks_of(FIRST))
    assert not blocks_of({**SECOND, "tool_choice": "none"}).continues(blocks_of(FIRST))
    # A field of an earlier message a template may render, rewritten at the same length.
    called = chat(user("run it"), {"role": "tool", "tool_call_id": "call_1", "content": "ok"})
    recalled = chat(user("run it"), {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
                    user("and now?"))
    assert not blocks_of(recalled).continues(blocks_of(called))
    # The earlier prompt's last message grown in place (a part's block ends elsewhere).
    grown = chat({**user("list the files"), "content": user("list the files")["content"] + "!"})
    assert not blocks_of(grown).continues(blocks_of(FIRST))


def test_a_body_is_read_once_for_its_hint_and_its_blocks():
    body = {**chat(user("list the files"), {"role": "assistant", "content": "<think>ls</think>ok",
                                           "tool_calls": [{"id": "c1", "type": "function"}]},
                   tools=TOOLS), "prompt_cache_key": "agent-7"}
    prompt = read_prompt(body)
    # What the conversation says, for the hint: its roles and contents, not its tools'
    # or its calls' JSON.
    assert list(prompt.said()) == ["\x1esystem\x1f", HEAD, "\x1euser\x1f",
                                   user("list the files")["content"], "\x1eassistant\x1f",
                                   "<think>ls</think>", "ok"]
    assert request_hint("f", [], body, prompt=prompt) == request_hint("f", [], body)
    assert prompt.blocks(100) == prompt_blocks(body, 100)
    assert [p.kind for p in prompt.blocks().parts] == [
        "tools", "system", "user", "reasoning", "assistant", "assistant"]
    assert read_prompt({"model": "m"}) is NO_PROMPT and NO_PROMPT.blocks() is NO_BLOCKS


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def test_each_field_of_a_message_a_template_may_render_is_a_part_in_the_order_it_renders():
    """A message's reasoning, its content, its tool calls and its other fields (a name, a
    tool call's id) are each a part, in that order, whatever order the body gives them
    in; a message of a role and a content is those two alone; what the conversation says
    is its contents, not the JSON of its calls or fields."""
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "run", "arguments": "{\"command\": \"ls\"}"}}]
    item = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    body: dict[str, Any] = {"temperature": 0, "messages": [
        {"role": "user", "content": "list the files"},
        {"tool_calls": calls, "name": "büro", "content": "<think>ls</think>Here.",
         "reasoning_content": "first ls", "role": "assistant"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.py"}]},
        {"role": "user", "content": None},
        item]}
    assert read_prompt(body).parts == (
        ("role", "user", False), ("user", "list the files", True),
        ("role", "assistant", False), ("reasoning", "first ls", False),
        ("reasoning", "<think>ls</think>", True), ("assistant", "Here.", True),
        ("assistant", _compact(calls), False), ("assistant", _compact({"name": "büro"}), False),
        ("role", "tool", False), ("tool", "a.py", True),
        ("tool", _compact({"tool_call_id": "c1"}), False),
        ("role", "user", False),
        ("tool", _compact(item), False))
    # The other fields make the request's frame, in any order.
    assert read_prompt(body).frame == read_prompt(
        {"messages": body["messages"], "temperature": 0}).frame
    assert read_prompt(body).frame != read_prompt({**body, "temperature": 1}).frame
