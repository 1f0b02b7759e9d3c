"""`--self-test MODEL`: prove that this installation works, end to end, and exit.

Loads MODEL in a real llama-server (one slot, small context), opens the
OpenAI-compatible port on loopback, answers one chat completion through that port
with an ordinary HTTP client, prints one summary line and closes everything.  Exit
status 0 means every piece a user relies on works: the engine is found, the model
loads, admission and the gateway forward a request and the answer comes back.

Headless (no Qt).  The window's `--self-test` runs the same coroutine on its backend
thread, with the window's own service, while the window is shown:

    future = backend_thread.submit(run_self_test(model, llama_server=..., service=service))

Also runnable alone: `python -m backend.app.self_test MODEL [--llama-server PATH]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TextIO

import httpx

from backend.api_paths import CHAT, COMPLETIONS
from backend.llama.engine import Engine
from backend.errors import EngineNotFound, StudioError
from backend.settings import Settings

if TYPE_CHECKING:
    from backend.app.service import StudioService

PASSED = "GGUF Studio self-test passed:"
FAILED = "GGUF Studio self-test FAILED:"

DEFAULT_CTX_SIZE = 512
DEFAULT_TIMEOUT = 180.0
PROMPT = "Say hello."
MAX_TOKENS = 8


class SelfTestFailed(Exception):
    """One step of the self-test did not work; the message says which and why."""


async def run_self_test(model_path: str | os.PathLike[str], *, llama_server: str | os.PathLike[str] | None = None,
                        service: "StudioService | None" = None, ctx_size: int = DEFAULT_CTX_SIZE,
                        timeout: float = DEFAULT_TIMEOUT, out: TextIO | None = None,
                        err: TextIO | None = None) -> int:
    """Load `model_path`, answer one chat completion through the port, report; 0 when it all worked.

    Without `service` the test brings its own (loopback, ephemeral port, a temporary log
    dir) and closes it.  With one (the window's), it uses that service's port and engine
    and unloads the model afterwards, leaving the service open.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            summary = await _run(Path(model_path), llama_server, service, ctx_size, started)
    except TimeoutError:
        _say(err, f"{FAILED} it did not finish within {timeout:g} s.")
        return 1
    except SelfTestFailed as exc:
        _say(err, f"{FAILED} {exc}")
        return 1
    except StudioError as exc:
        _say(err, f"{FAILED} {exc}")
        tail = getattr(exc, "log_tail", "")
        if tail:
            _say(err, "--- last lines of the llama-server log ---\n" + tail.rstrip())
        return 1
    _say(out, f"{PASSED} {summary}")
    return 0


async def _run(model: Path, llama_server: str | os.PathLike[str] | None,
               service: "StudioService | None", ctx_size: int, started: float) -> str:
    from backend.models.gguf_info import read_model_info
    from backend.app.service import StudioService
    from backend.llama.load import LoadSettings

    if not model.is_file():
        raise SelfTestFailed(f"no model file at {model}.")
    info = read_model_info(model)  # a clear error for a file that is not a GGUF model

    own = service is None
    logs: tempfile.TemporaryDirectory[str] | None = None
    if own:
        binary = resolve_engine(llama_server)
        logs = tempfile.TemporaryDirectory(prefix="gguf-studio-self-test-")
        settings = Settings(host="127.0.0.1", port=0, llama_server=str(binary),
                            load_timeout=120.0, reload_grace=0.0)
        service = StudioService(settings, log_dir=Path(logs.name))
    elif service is not None and llama_server is not None:
        service.settings = service.settings.replace(llama_server=str(resolve_engine(llama_server)))
    assert service is not None
    try:
        await service.start_gateway()
        port = service.gateway_port
        spec = LoadSettings(parallel="1", ctx_size=ctx_size).to_spec(
            str(model), own_template=info.has_chat_template)
        load_started = time.monotonic()
        try:
            snapshot = await service.load(spec)
        except StudioError as exc:
            tail = getattr(exc, "log_tail", "") or "\n".join(service.log_tail(30))
            raise _LoadFailed(f"the model did not load: {exc}", tail) from None
        load_seconds = time.monotonic() - load_started

        host = _client_host(service.settings.host)
        headers = {"Authorization": f"Bearer {service.settings.api_key}"} if service.settings.api_key else {}
        # A model without a chat template takes no chats through the port: a plain prompt.
        chats = info.has_chat_template
        body: dict[str, Any] = {"model": snapshot.model_id, "max_tokens": MAX_TOKENS, "stream": False}
        if chats:
            body["messages"] = [{"role": "user", "content": PROMPT}]
        else:
            body["prompt"] = PROMPT
        request_started = time.monotonic()
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", headers=headers,
                                     timeout=60.0, trust_env=False) as client:
            try:
                response = await client.post(CHAT if chats else COMPLETIONS,
                                             json=body)
            except httpx.HTTPError as exc:
                raise SelfTestFailed(f"the request to its own port failed: {exc!r}.") from None
        request_seconds = time.monotonic() - request_started
        answer = _check_answer(response, chats)
        tokens = (answer.get("usage") or {}).get("completion_tokens")
        choice = answer["choices"][0]
        text = ((choice.get("message") or {}).get("content") if chats else choice.get("text")) or ""
        return (f"{snapshot.model_id} loaded in {load_seconds:.1f} s "
                f"({snapshot.serving.slots if snapshot.serving else 0} slot, ctx {ctx_size}); "
                f"1 {'chat completion' if chats else 'completion (no chat template)'} through "
                f"port {port} in {request_seconds:.2f} s "
                f"({tokens if tokens is not None else '?'} tokens, finish_reason "
                f"{choice.get('finish_reason')}, {len(text)} chars); "
                f"total {time.monotonic() - started:.1f} s")
    finally:
        if own:
            await service.close()
            if logs is not None:
                logs.cleanup()
        else:
            await service.unload()


class _LoadFailed(StudioError):
    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


def resolve_engine(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The llama-server the app would use; an explicit path must itself be usable.

    Order, as in the app: `explicit` (--llama-server), GGUF_STUDIO_LLAMA_SERVER (or the
    saved setting), the managed engine, PATH.
    """
    if explicit is None:
        explicit = _saved_llama_server()
    resolution = Engine().resolve(explicit)
    if explicit:
        first = resolution.candidates[0]
        if not first.usable:
            why = "is not an executable file" if first.path and first.path.exists() else "does not exist"
            raise SelfTestFailed(f"the llama-server given, {first.path}, {why}.")
    try:
        return resolution.path
    except EngineNotFound as exc:
        raise SelfTestFailed(str(exc)) from None


def _saved_llama_server() -> str | None:
    """The engine path in the saved settings (or GGUF_STUDIO_LLAMA_SERVER), if any."""
    try:
        return Settings.load().llama_server or None
    except StudioError:
        return None  # an unreadable settings file is the window's business, not the test's


def _client_host(bind_host: str) -> str:
    if bind_host in {"", "0.0.0.0"}:
        return "127.0.0.1"
    if bind_host == "::":
        return "[::1]"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


def _check_answer(response: httpx.Response, chat: bool) -> dict[str, Any]:
    if response.status_code != 200:
        raise SelfTestFailed(f"its own port answered HTTP {response.status_code}: {response.text[:300]}")
    what = "a chat completion" if chat else "a completion"
    try:
        answer: dict[str, Any] = response.json()
        choices = answer["choices"]
        if not choices or ("message" if chat else "text") not in choices[0]:
            raise ValueError(f"no choice with {'a message' if chat else 'a text'}")
    except (ValueError, KeyError, TypeError) as exc:
        raise SelfTestFailed(f"the answer is not {what} ({exc}): {response.text[:300]}") from None
    return answer


def _say(stream: TextIO | None, line: str) -> None:
    """Print when there is somewhere to print (a windowed Windows app has no stdout)."""
    if stream is None:
        return
    try:
        print(line, file=stream, flush=True)
    except (OSError, ValueError):
        pass


# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-server", metavar="PATH", help="llama-server binary to use")
    parser.add_argument("--ctx-size", type=int, default=DEFAULT_CTX_SIZE,
                        help=f"context size for the test load (default {DEFAULT_CTX_SIZE})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds the whole test may take (default {DEFAULT_TIMEOUT:g})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gguf-studio --self-test",
                                     description="Load MODEL, answer one request through the port, exit.")
    parser.add_argument("model", metavar="MODEL", help="GGUF file to load")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return asyncio.run(run_self_test(args.model, llama_server=args.llama_server,
                                     ctx_size=args.ctx_size, timeout=args.timeout))


if __name__ == "__main__":
    sys.exit(main())
