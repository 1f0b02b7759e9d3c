"""The chat playground without the window: one conversation with a model of the pool,
held and streamed here, sent through the port like any client's.

The session talks to the app's own port over HTTP (`/v1/chat/completions`, streamed;
`/v1/completions` in plain completion, which a model without a chat template takes
instead of chats: the conversation is then one text the model continues),
with the Chat tab's own key (`StudioService.chat_secret`, made for the run and never
saved: the owner's rights on models, a flow of its own, booked in usage and named in the
inspector as "chat tab"; on `/requests` it reads its own records only), straight to the
port and never through a proxy of the environment (`HTTP_PROXY`), so what the owner
sees is what an agent gets: the same admission, the same answers.  Each conversation names itself to the port with a `prompt_cache_key` of
its own (`studio-chat-…`): the request's session, by which the port places each turn
where the last one left the conversation's prefix (so the next turn's cached tokens show
in its figures) and by which its records name the conversation.

Stop cancels the request (the port closes the engine's request and frees its slot) and
keeps what arrived, with what the cache held for its prompt (each chunk carries the
engine's timings, asked with `timings_per_token`); an answer the engine ended at Max
tokens says so; regenerate drops the last answer and sends the conversation again;
clear stops and sets the conversation aside, and the next turn starts a new session;
`undo_clear` brings the last one back while nothing new was said.

All methods run on one asyncio loop (the window's backend loop); `on_change` is called
there after every change, and `state` is a frozen picture that may cross to any thread.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import secrets
import ssl
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import httpx

from backend.api_paths import CHAT, COMPLETIONS
from backend.app.service import StudioService

__all__ = [
    "SESSION_PREFIX",
    "USER_AGENT",
    "AnswerFigures",
    "AnswerState",
    "ChatOptions",
    "ChatSession",
    "ChatState",
    "PortAddress",
    "Turn",
    "port_of",
    "prompt_text",
]

#: Each conversation's `prompt_cache_key` starts so: its session in the port's records.
SESSION_PREFIX = "studio-chat-"
USER_AGENT = "gguf-studio-chat"
#: A model may be loading on demand or the line long: the port sends keep-alives meanwhile.
TIMEOUT = httpx.Timeout(600.0, connect=10.0)


@dataclass(frozen=True)
class PortAddress:
    """Where the app's own port listens and the owner's key ("" when none is set)."""

    base_url: str
    api_key: str = ""


@dataclass(frozen=True)
class ChatOptions:
    """What the next answer is asked with."""

    model: str
    system_prompt: str = ""
    temperature: float = 0.7
    max_tokens: int = 512
    #: Plain completion (`/v1/completions`): the conversation is one text the model
    #: continues, without a chat template; the system prompt is not used.
    completion: bool = False


class AnswerState(enum.Enum):
    WAITING = "waiting"  # sent; nothing has come back yet
    STREAMING = "streaming"
    DONE = "done"
    STOPPED = "stopped"  # stopped on request: the text is what arrived
    FAILED = "failed"


@dataclass(frozen=True)
class AnswerFigures:
    """How an answer came, measured on its stream: seconds to the first token, tokens a
    second after it, and what the port's usage says of the prompt (cached tokens: the
    prefix the engine had kept, None when the answer did not say)."""

    first_token_seconds: float | None = None
    tokens_per_second: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    #: The engine ended it at the answer's limit (Max tokens): it was cut, not finished.
    cut_at_limit: bool = False

    def describe(self) -> str:
        parts = ["cut at Max tokens"] if self.cut_at_limit else []
        if self.first_token_seconds is not None:
            parts.append(f"first token {self.first_token_seconds:.2f} s")
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:.1f} tok/s")
        parts.append(f"{self.output_tokens} tokens")
        if self.cached_tokens is not None:
            parts.append(f"{self.cached_tokens} of {self.prompt_tokens} prompt tokens cached"
                         if self.prompt_tokens is not None else f"{self.cached_tokens} cached")
        return " · ".join(parts)


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"
    text: str
    state: AnswerState = AnswerState.DONE
    model: str = ""
    figures: AnswerFigures | None = None
    error: str = ""


@dataclass(frozen=True)
class ChatState:
    turns: tuple[Turn, ...] = ()
    streaming: bool = False
    session: str = ""
    #: A cleared conversation `undo_clear` can bring back.
    can_undo_clear: bool = False

    @property
    def can_regenerate(self) -> bool:
        return any(turn.role == "user" for turn in self.turns)


class ChatSession:
    def __init__(self, port: Callable[[], PortAddress | None], *,
                 on_change: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._port = port
        self._on_change = on_change or (lambda: None)
        self._clock = clock
        self._turns: list[Turn] = []
        self._session = _new_session()
        #: The conversation the last clear set aside, and its session (until a new turn).
        self._cleared: tuple[list[Turn], str] | None = None
        self._task: asyncio.Task[None] | None = None  # the answer's request
        self._answered = asyncio.Event()  # set when no answer is being handled
        self._answered.set()
        self.state = ChatState(session=self._session)

    @classmethod
    def of_service(cls, service: StudioService, **kwargs: Any) -> ChatSession:
        """A session with `service`'s port, wherever it listens now and with its key now."""
        return cls(lambda: port_of(service), **kwargs)

    # --- intent ---------------------------------------------------------------------------

    async def send(self, text: str, options: ChatOptions) -> Turn:
        """Add the person's `text` and stream the model's answer; the answer as it ended."""
        await self.stop()
        self._cleared = None  # a new conversation began: the cleared one is gone
        self._turns.append(Turn("user", text))
        return await self._answer(options)

    async def regenerate(self, options: ChatOptions) -> Turn | None:
        """Drop the last answer and ask again; None when nothing was asked yet."""
        await self.stop()
        while self._turns and self._turns[-1].role == "assistant":
            self._turns.pop()
        if not self._turns:
            self._publish()
            return None
        return await self._answer(options)

    async def stop(self) -> None:
        """End the answer streaming now, keeping what arrived."""
        if self._task is not None:
            self._task.cancel()
        await self._answered.wait()

    async def clear(self) -> None:
        """Stop, set the conversation aside (`undo_clear` brings it back until the next
        turn); the next turn is a new session."""
        await self.stop()
        if self._turns:
            self._cleared = (list(self._turns), self._session)
        self._turns.clear()
        self._session = _new_session()
        self._publish()

    async def undo_clear(self) -> None:
        """The conversation the last clear set aside, back with its session."""
        if self._cleared is not None and not self._turns:
            turns, self._session = self._cleared
            self._turns = list(turns)
            self._cleared = None
            self._publish()

    def request_body(self, options: ChatOptions) -> dict[str, Any]:
        """What the next answer is asked with: the conversation so far (failed answers and
        empty ones left out) after the system prompt; in plain completion, the
        conversation as one text (`prompt_text`)."""
        said = [turn for turn in self._turns
                if turn.text and turn.state in (AnswerState.DONE, AnswerState.STOPPED)]
        asked: dict[str, Any]
        if options.completion:
            asked = {"prompt": prompt_text(said)}
        else:
            messages = [{"role": "system", "content": options.system_prompt}] \
                if options.system_prompt.strip() else []
            messages += [{"role": turn.role, "content": turn.text} for turn in said]
            asked = {"messages": messages}
        # The engine's timings with every chunk: an answer stopped on request keeps what
        # the cache held for its prompt (the usage comes at the end only).
        return {"model": options.model, **asked, "stream": True,
                "stream_options": {"include_usage": True}, "timings_per_token": True,
                "temperature": options.temperature, "max_tokens": options.max_tokens,
                "prompt_cache_key": self._session}

    # --- streaming --------------------------------------------------------------------------

    async def _answer(self, options: ChatOptions) -> Turn:
        body = self.request_body(options)
        self._turns.append(Turn("assistant", "", AnswerState.WAITING, options.model))
        index = len(self._turns) - 1
        path = COMPLETIONS if options.completion else CHAT  # plain completion: the text continued
        task = asyncio.create_task(self._stream(path, body, index))
        self._task = task
        self._answered.clear()
        self._publish()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                task.cancel()
                raise  # our caller is cancelled, not just the answer
            self._end(index, AnswerState.STOPPED)
        finally:
            self._task = None
            self._answered.set()
            self._publish()
        return self._turns[index]

    async def _stream(self, path: str, body: dict[str, Any], index: int) -> None:
        port = self._port()
        if port is None:
            self._fail(index, "The port is not open.")
            return
        headers = {"user-agent": USER_AGENT}
        if port.api_key:
            headers["authorization"] = f"Bearer {port.api_key}"
        reading = _Reading(self._clock())
        try:
            # Never through a proxy the environment names: the request carries the
            # owner-rights secret and the whole conversation, and goes to this machine.
            async with httpx.AsyncClient(timeout=TIMEOUT, trust_env=False, verify=_tls()) as client, \
                    client.stream("POST", port.base_url + path, json=body,
                                  headers=headers) as response:
                if response.status_code != 200:
                    self._fail(index, _error_message(await response.aread(), response.status_code))
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # keep-alive comments, blank lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    if not self._take(index, reading, data):
                        return
        except httpx.HTTPError as exc:
            self._fail(index, f"The port did not answer: {str(exc) or type(exc).__name__}.")
            return
        finally:
            self._set(index, figures=reading.figures(self._clock()))
        self._end(index, AnswerState.DONE)

    def _take(self, index: int, reading: _Reading, data: str) -> bool:
        """Apply one event of the stream; False when it was an error."""
        try:
            event = json.loads(data)
        except ValueError:
            return True
        if not isinstance(event, dict):
            return True
        error = event.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else str(error)
            self._fail(index, str(message or "The model failed."))
            return False
        reading.note_figures(event)
        text = _delta_text(event)
        if text:
            reading.note_token(self._clock())
            turn = self._turns[index]
            self._turns[index] = replace(turn, text=turn.text + text,
                                         state=AnswerState.STREAMING)
            self._publish()
        return True

    def _fail(self, index: int, message: str) -> None:
        self._set(index, state=AnswerState.FAILED, error=message)

    def _end(self, index: int, state: AnswerState) -> None:
        if index < len(self._turns) and self._turns[index].state in (AnswerState.WAITING, AnswerState.STREAMING):
            self._set(index, state=state)

    def _set(self, index: int, **changes: Any) -> None:
        if index < len(self._turns):
            self._turns[index] = replace(self._turns[index], **changes)
        self._publish()

    def _publish(self) -> None:
        streaming = self._task is not None and not self._task.done()
        self.state = ChatState(tuple(self._turns), streaming, self._session,
                               can_undo_clear=self._cleared is not None and not self._turns)
        self._on_change()


def prompt_text(turns: list[Turn]) -> str:
    """The conversation as one text for plain completion: each answer continues the text
    before it, and each of the person's turns after the first starts a new line."""
    text = ""
    for turn in turns:
        if turn.role == "user" and text and not text.endswith("\n"):
            text += "\n"
        text += turn.text
    return text


def port_of(service: StudioService) -> PortAddress | None:
    """`service`'s port as a client on this machine reaches it, with the Chat tab's key
    (the owner's, with a flow and usage of its own)."""
    port = service.gateway_port
    if port is None:
        return None
    host = service.settings.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return PortAddress(f"http://{host}:{port}", service.chat_secret)


# --- helpers --------------------------------------------------------------------------


class _Reading:
    """What the stream has told so far of its answer's timing and usage."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.chunks = 0
        self.completion: int | None = None
        self.prompt: int | None = None
        self.cached: int | None = None
        self.cut = False

    def note_token(self, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.chunks += 1

    def note_figures(self, event: dict[str, Any]) -> None:
        """The engine's figures as an event tells them: its usage (the last event's), or
        the timings every chunk carries (the newest kept: the first chunk may come before
        the prompt was read)."""
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.completion = _int(usage.get("completion_tokens"), self.completion)
            self.prompt = _int(usage.get("prompt_tokens"), self.prompt)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.cached = _int(details.get("cached_tokens"), self.cached)
        timings = event.get("timings")
        if isinstance(timings, dict) and not isinstance(usage, dict):
            cached = _int(timings.get("cache_n"), None)
            computed = _int(timings.get("prompt_n"), None)
            if cached is not None:
                self.cached = cached
                if computed is not None:
                    self.prompt = cached + computed
        choices = event.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
                and choices[0].get("finish_reason") == "length":
            self.cut = True

    def figures(self, now: float) -> AnswerFigures:
        tokens = self.completion if self.completion is not None else self.chunks
        first = None if self.first_at is None else self.first_at - self.sent_at
        speed = None
        if self.first_at is not None and self.last_at is not None and self.chunks > 1 \
                and self.last_at > self.first_at:
            # The tokens after the first, over the time they took to come.
            speed = (self.chunks - 1) / (self.last_at - self.first_at)
        return AnswerFigures(first, speed, tokens, self.prompt, self.cached, self.cut)


def _delta_text(event: dict[str, Any]) -> str:
    """The text a chat chunk (`delta.content`) or a completion chunk (`text`) adds."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    text = choices[0].get("text")
    if isinstance(text, str):
        return text
    delta = choices[0].get("delta")
    if not isinstance(delta, dict):
        return ""
    content = delta.get("content")
    return content if isinstance(content, str) else ""


def _error_message(body: bytes, status: int) -> str:
    try:
        error = json.loads(body).get("error", {})
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = None
    return f"The port answered HTTP {status}" + (f": {message}" if message else ".")


def _int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _new_session() -> str:
    return SESSION_PREFIX + secrets.token_hex(8)


@functools.cache
def _tls() -> ssl.SSLContext:
    """The machine's certificates, loaded once a process: a client made with a load of its
    own held the backend loop (and every stream through the port) 50-120 ms per message."""
    return httpx.create_ssl_context(trust_env=False)
