"""Chat bodies the tests of prompts, their verdicts and the session book share."""

from __future__ import annotations

from typing import Any

from backend.admission.prompt import prompt_blocks

__all__ = ["AGENT", "AGENT_NEXT", "FIRST", "HEAD", "SECOND", "TITLE", "TOOLS", "blocks_of", "chat",
           "user"]

HEAD = "You are a coding agent. " + "Follow the rules of the repository. " * 120
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "run", "description": "Run a command.",
                                           "parameters": {"type": "object", "properties": {
                                               "command": {"type": "string"}}}}}]


def chat(*messages: dict[str, Any], system: str = HEAD, tools: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": system},
                                                      *messages]}
    if tools is not None:
        body["tools"] = tools
    return body


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text + " and more words of the tool output. " * 40}


FIRST = chat(user("list the files"))
SECOND = chat(user("list the files"), {"role": "assistant", "content": "Here they are."},
              user("open main.py"))


# OpenCode's requests of one session, as 1.18 sends them (both with the session's
# x-session-affinity): its title request, then its agent's turns (tools, its own system).
TITLE = chat({"role": "user", "content": "Generate a title for this conversation:\n"},
             {"role": "user", "content": "Say hello.\n"},
             system="You are a title generator. You output ONLY a thread title.")
AGENT = chat({"role": "user", "content": "Say hello.\n"}, tools=TOOLS)
AGENT_NEXT = chat({"role": "user", "content": "Say hello.\n"},
                  {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "Now in French.\n"}, tools=TOOLS)


def blocks_of(body: dict[str, Any]) -> Any:
    return prompt_blocks(body, size=len(str(body)))
