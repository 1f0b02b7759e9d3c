"""bench/watchdogs.py — what each real coding client counts as life on a silent stream.

Runs the real clients (Codex CLI, OpenCode, Claude Code, as `scripts/install-clients`
installs them) against a fake server, with each client's stream timeout set short, while
the server keeps one streamed answer silent for several timeouts but for one kind of
keep-alive, then answers.  Per run it prints whether the client finished in one attempt,
how many times it sent the request (and whether each resend was the same body), when it
hung up, and its exit.

A fake server, not the port, on purpose: what is measured is the client's watchdog, which
needs a silence of an exact length filled with exactly one kind of keep-alive at an exact
interval; the real engine gives neither (its prefill time varies with the machine, and
the port sends its own keep-alives).  The answer after the silence is a short stream in the
shapes llama-server sends through the port (captured once, the text replaced).

    .venv/bin/python bench/watchdogs.py                       # every client, every kind
    .venv/bin/python bench/watchdogs.py --client claude --kind ping --silence 40
    .venv/bin/python bench/watchdogs.py --list                # the kinds per wire

Nothing here reaches beyond 127.0.0.1: every client runs offline (no telemetry, update
checks or model catalogues) in a throwaway HOME.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ANSWER = "Hello from the fake server."
KEY = "watchdog-probe-key-0123456789"
MODEL = "fake-model"

# --- what the fake server sends -------------------------------------------------------------


def _named(name: str, payload: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def _data(payload: dict | str) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {text}\n\n".encode()


def messages_start() -> bytes:
    return _named("message_start", {"type": "message_start", "message": {
        "id": "msg_fake", "type": "message", "role": "assistant", "content": [],
        "model": MODEL, "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 30, "output_tokens": 0}}})


def messages_rest() -> bytes:
    words = ANSWER.split(" ")
    deltas = b"".join(_named("content_block_delta", {
        "type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": (" " if i else "") + word}})
        for i, word in enumerate(words))
    return (_named("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}})
            + deltas
            + _named("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _named("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                       "usage": {"output_tokens": len(words)}})
            + _named("message_stop", {"type": "message_stop"}))


def chat_chunk(delta: dict, finish: str | None = None, **more: object) -> bytes:
    return _data({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                  "model": MODEL, "choices": [{"index": 0, "delta": delta,
                                               "finish_reason": finish}], **more})


def chat_answer() -> bytes:
    words = ANSWER.split(" ")
    return (chat_chunk({"role": "assistant", "content": None})
            + b"".join(chat_chunk({"content": (" " if i else "") + w}) for i, w in enumerate(words))
            + chat_chunk({}, "stop")
            + _data({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                     "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": 30, "completion_tokens": len(words),
                               "total_tokens": 30 + len(words)}})
            + _data("[DONE]"))


def _response(status: str, output: list | None = None) -> dict:
    body: dict = {"id": "resp_fake", "object": "response", "status": status, "model": MODEL}
    if output is not None:
        body |= {"created_at": 0, "output": output,
                 "usage": {"input_tokens": 30, "output_tokens": 5, "total_tokens": 35,
                           "input_tokens_details": {"cached_tokens": 0}}}
    return body


def responses_created() -> bytes:
    return _named("response.created", {"type": "response.created",
                                       "response": _response("in_progress")})


def responses_in_progress() -> bytes:
    return _named("response.in_progress", {"type": "response.in_progress",
                                           "response": _response("in_progress")})


def responses_rest() -> bytes:
    item_id = "msg_fake"
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ANSWER}
    item = {"type": "message", "status": "completed", "id": item_id, "role": "assistant",
            "content": [part]}
    words = ANSWER.split(" ")
    return (_named("response.output_item.added", {
                "type": "response.output_item.added",
                "item": {"content": [], "id": item_id, "role": "assistant",
                         "status": "in_progress", "type": "message"}})
            + _named("response.content_part.added", {
                "type": "response.content_part.added", "item_id": item_id,
                "part": {"type": "output_text", "text": ""}})
            + b"".join(_named("response.output_text.delta", {
                "type": "response.output_text.delta", "item_id": item_id,
                "delta": (" " if i else "") + w}) for i, w in enumerate(words))
            + _named("response.output_text.done", {"type": "response.output_text.done",
                                                   "item_id": item_id, "text": ANSWER})
            + _named("response.content_part.done", {"type": "response.content_part.done",
                                                    "item_id": item_id, "part": part})
            + _named("response.output_item.done", {"type": "response.output_item.done",
                                                   "item": item})
            + _named("response.completed", {"type": "response.completed",
                                            "response": _response("completed", [item])}))


COMMENT = b": keep-alive\n\n"


@dataclass(frozen=True)
class Kind:
    """One way of filling a silence: `first` once after the headers, `repeat` every
    interval, `late_headers`: no headers at all until the answer."""

    name: str
    what: str
    first: bytes = b""
    repeat: bytes = b""
    late_headers: bool = False


def _common() -> list[Kind]:
    return [Kind("late-headers", "no response headers until the answer", late_headers=True),
            Kind("silent", "headers, then nothing"),
            Kind("comment", "SSE comments `: keep-alive`", repeat=COMMENT)]


KINDS: dict[str, list[Kind]] = {
    "messages": _common() + [
        Kind("ping", "`event: ping` events", repeat=_named("ping", {"type": "ping"})),
        Kind("start", "`message_start` early, then nothing", first=messages_start()),
        Kind("start+comment", "`message_start` early, then comments", first=messages_start(),
             repeat=COMMENT),
        Kind("start+ping", "`message_start` early, then `ping` events", first=messages_start(),
             repeat=_named("ping", {"type": "ping"})),
    ],
    "chat": _common() + [
        Kind("empty-delta", "chunks with an empty delta `{}`", repeat=chat_chunk({})),
        Kind("role-delta", "chunks with `{\"role\": \"assistant\"}`",
             repeat=chat_chunk({"role": "assistant"})),
        Kind("empty-content", "chunks with `{\"content\": \"\"}`", repeat=chat_chunk({"content": ""})),
        Kind("no-choices", "chunks with `choices: []`",
             repeat=_data({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                           "created": 0, "model": MODEL, "choices": []})),
    ],
    "responses": _common() + [
        Kind("created", "`response.created` once, then nothing", first=responses_created()),
        Kind("in_progress", "`response.created`, then `response.in_progress` events",
             first=responses_created(), repeat=responses_in_progress()),
        Kind("created+comment", "`response.created`, then comments",
             first=responses_created(), repeat=COMMENT),
    ],
}


def answer_after(wire: str, kind: Kind) -> bytes:
    if wire == "messages":
        return (b"" if kind.first.startswith(b"event: message_start") else messages_start()) \
            + messages_rest()
    if wire == "chat":
        return chat_answer()
    created = kind.first.startswith(b"event: response.created")
    return (b"" if created else responses_created() + responses_in_progress()) + responses_rest()


# --- the fake server ------------------------------------------------------------------------

@dataclass
class Seen:
    at: float  # seconds since the run began
    path: str
    digest: str  # of the body: a resend of the same request has the same
    auth: str  # which credential header it came with
    hung_up_after: float | None = None  # seconds after it came that the client left
    answered: bool = False


@dataclass
class FakeServer:
    wire: str
    kind: Kind
    silence: float
    interval: float
    started: float = field(default_factory=time.monotonic)
    seen: list[Seen] = field(default_factory=list)
    others: list[str] = field(default_factory=list)  # "METHOD PATH" of every other request
    port: int = 0

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip()
                           for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await _read_body(reader, headers)
                if method == "POST" and path.split("?")[0].rstrip("/").endswith(
                        ("/messages", "/chat/completions", "/responses")):
                    keep = await self._stream(reader, writer, path, headers, body)
                    if not keep:
                        return
                    continue
                self.others.append(f"{method} {path}")
                if path.split("?")[0].endswith("/count_tokens"):
                    await _send_json(writer, 200, {"input_tokens": 30})
                else:
                    await _send_json(writer, 404, {"error": {"message": "not here"}})
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      path: str, headers: dict[str, str], body: bytes) -> bool:
        auth = " + ".join(
            name for name, there in (("Authorization: Bearer", headers.get(
                "authorization", "").startswith("Bearer ")), ("x-api-key", "x-api-key" in headers))
            if there) or "none"
        seen = Seen(time.monotonic() - self.started, path,
                    hashlib.sha256(body).hexdigest()[:12], auth)
        self.seen.append(seen)
        came = time.monotonic()
        gone = asyncio.ensure_future(reader.read(1))  # b"" once the client hangs up

        def chunk(data: bytes) -> bytes:
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        async def silent_until(deadline: float, repeat: bytes) -> bool:
            while (left := deadline - time.monotonic()) > 0:
                pause = min(left, self.interval) if repeat else left
                done, _ = await asyncio.wait({gone}, timeout=pause)
                if done:
                    return False
                if repeat and deadline - time.monotonic() > 0:
                    writer.write(chunk(repeat))
                    await writer.drain()
            return True

        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            if not self.kind.late_headers:
                writer.write(head + (chunk(self.kind.first) if self.kind.first else b""))
                await writer.drain()
            alive = await silent_until(came + self.silence, self.kind.repeat)
            if alive:
                if self.kind.late_headers:
                    writer.write(head)
                writer.write(chunk(answer_after(self.wire, self.kind)) + b"0\r\n\r\n")
                await writer.drain()
                seen.answered = True
                done, _ = await asyncio.wait({gone}, timeout=0.5)
                return not done
        except ConnectionError:
            pass
        seen.hung_up_after = time.monotonic() - came
        gone.cancel()
        return False


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return b"".join(parts)
            parts.append(data[:-2])
    return b""


async def _send_json(writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()


# --- the clients ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Installed:
    codex: Path
    opencode: Path
    opencode_plugin: Path
    claude: Path
    versions: dict[str, str]


def installed() -> Installed:
    out = subprocess.run([str(REPO / "scripts" / "install-clients")], capture_output=True,
                         text=True, check=True, timeout=600).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return Installed(Path(values["CODEX_BIN"]), Path(values["OPENCODE_BIN"]),
                     Path(values["OPENCODE_PLUGIN_DIR"]), Path(values["CLAUDE_BIN"]),
                     {"codex": values["CODEX_VERSION"], "opencode": values["OPENCODE_VERSION"],
                      "claude": values["CLAUDE_VERSION"]})


@dataclass(frozen=True)
class ClientSpec:
    name: str
    wire: str
    timeout: float  # the idle timeout it is set to, seconds (0: its default, left unset)
    retries: int  # resends allowed after a timeout, as set


WIRES = {"claude": "messages", "codex": "responses", "opencode": "chat"}


def client_env(home: Path) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
           "XDG_STATE_HOME": str(home / ".local/state"), "XDG_CACHE_HOME": str(home / ".cache"),
           "TMPDIR": str(home / "tmp"), "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1",
           "CI": "true", "PROBE_KEY": KEY}
    for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME", "TMPDIR"):
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    return env


def claude_argv(clients: Installed, port: int, home: Path, spec: ClientSpec,
                auth: str) -> tuple[list[str], dict[str, str]]:
    env = client_env(home) | {
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_MAX_RETRIES": str(spec.retries),
    }
    if spec.timeout:  # the watchdogs, short (Claude Code clamps each to at least 10 s)
        env |= {name: str(int(spec.timeout * 1000)) for name in (
            "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS", "CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS",
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS")}
    argv = [str(clients.claude), "-p", "Say hello.", "--output-format", "text"]
    if auth == "token":
        env["ANTHROPIC_AUTH_TOKEN"] = KEY
    elif auth == "api-key":
        env["ANTHROPIC_API_KEY"] = KEY
    else:  # apiKeyHelper
        helper = home / "key.sh"
        helper.write_text(f"#!/bin/sh\necho {KEY}\n")
        helper.chmod(0o700)
        settings = home / "probe-settings.json"
        settings.write_text(json.dumps({"apiKeyHelper": str(helper)}))
        argv += ["--settings", str(settings)]
    return argv, env


def codex_argv(clients: Installed, port: int, home: Path, spec: ClientSpec) -> tuple[list[str], dict[str, str]]:
    codex_home = home / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text("\n".join([
        f'model = "{MODEL}"', 'model_provider = "probe"', 'approval_policy = "never"',
        'sandbox_mode = "read-only"', "check_for_update_on_startup = false", "",
        "[model_providers.probe]", 'name = "probe"', f'base_url = "http://127.0.0.1:{port}/v1"',
        'env_key = "PROBE_KEY"', 'wire_api = "responses"',
        *([f"stream_idle_timeout_ms = {int(spec.timeout * 1000)}"] if spec.timeout else []),
        f"stream_max_retries = {spec.retries}", "request_max_retries = 0", "",
        "[features]", "plugins = false", "", "[analytics]", "enabled = false", ""]))
    work = home / "work"
    work.mkdir()
    env = client_env(home) | {"CODEX_HOME": str(codex_home)}
    return [str(clients.codex), "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral",
            "--color", "never", "-C", str(work), "Say hello."], env


OPENCODE_OFFLINE = {name: "1" for name in (
    "OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_AUTOUPDATE",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS", "OPENCODE_DISABLE_LSP_DOWNLOAD", "OPENCODE_DISABLE_SHARE",
    "OPENCODE_DISABLE_CLAUDE_CODE", "OPENCODE_DISABLE_EXTERNAL_SKILLS",
    "OPENCODE_DISABLE_PROJECT_CONFIG", "OPENCODE_DISABLE_TERMINAL_TITLE",
    "OPENCODE_DISABLE_AUTOCOMPACT", "OPENCODE_DISABLE_PRUNE")}


def opencode_argv(clients: Installed, port: int, home: Path, spec: ClientSpec) -> tuple[list[str], dict[str, str]]:
    env = client_env(home) | OPENCODE_OFFLINE
    config_dir = home / ".config" / "opencode"
    config_dir.mkdir(parents=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(clients.opencode_plugin / name, config_dir / name)
    (config_dir / "node_modules").symlink_to(clients.opencode_plugin / "node_modules")
    timeouts = {"chunkTimeout": int(spec.timeout * 1000),
                "headerTimeout": int(spec.timeout * 1000)} if spec.timeout else {}
    (config_dir / "opencode.json").write_text(json.dumps({
        "model": f"probe/{MODEL}", "small_model": f"probe/{MODEL}", "autoupdate": False,
        "share": "disabled",
        "provider": {"probe": {"npm": "@ai-sdk/openai-compatible", "name": "probe",
                               "options": {"baseURL": f"http://127.0.0.1:{port}/v1",
                                           "apiKey": "{env:PROBE_KEY}", **timeouts},
                               "models": {MODEL: {"name": MODEL}}}}}))
    (home / "work").mkdir()
    return [str(clients.opencode), "run", "Say hello."], env


@dataclass
class Outcome:
    client: str
    kind: Kind
    exit: int | None
    seconds: float
    seen: list[Seen]
    output: str
    others: list[str]

    @property
    def answered(self) -> bool:
        return ANSWER in self.output

    def row(self) -> str:
        attempts = len(self.seen)
        same = len({s.digest for s in self.seen})
        hung = [f"{s.hung_up_after:.1f}" for s in self.seen if s.hung_up_after is not None]
        verdict = ("one attempt" if self.answered and attempts == 1
                   else f"answered on attempt {attempts}" if self.answered
                   else "failed" if self.exit is not None else "killed")
        return (f"| {self.client} | {self.kind.name} | {verdict} | {attempts} ({same} distinct) | "
                f"{', '.join(hung) or '—'} | {self.exit} | {self.seconds:.1f} |")


async def probe(clients: Installed, spec: ClientSpec, kind: Kind, silence: float,
                interval: float, limit: float, auth: str = "token") -> Outcome:
    fake = FakeServer(spec.wire, kind, silence, interval)
    server = await fake.start()
    with tempfile.TemporaryDirectory(prefix=f"watchdog-{spec.name}-") as tmp:
        home = Path(tmp)
        if spec.name == "claude":
            argv, env = claude_argv(clients, fake.port, home, spec, auth)
        elif spec.name == "codex":
            argv, env = codex_argv(clients, fake.port, home, spec)
        else:
            argv, env = opencode_argv(clients, fake.port, home, spec)
        fake.started = started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=home / "work" if (home / "work").exists() else home,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), limit)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = await proc.communicate()
            code = None
        else:
            code = proc.returncode
        server.close()
        return Outcome(spec.name, kind, code, time.monotonic() - started, fake.seen,
                       out.decode(errors="replace"), fake.others)


SPECS = {"claude": ClientSpec("claude", "messages", 10.0, 2),
         "codex": ClientSpec("codex", "responses", 3.0, 2),
         "opencode": ClientSpec("opencode", "chat", 3.0, 2)}


async def main_async(args: argparse.Namespace) -> int:
    if args.list:
        for wire, kinds in KINDS.items():
            print(wire + ": " + ", ".join(f"{k.name} ({k.what})" for k in kinds))
        return 0
    clients = installed()
    print(f"clients: {clients.versions}", flush=True)
    print("| client | keep-alive | outcome | requests | hung up after (s) | exit | seconds |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name in args.client or list(SPECS):
        spec = SPECS[name]
        if args.timeout is not None:
            spec = ClientSpec(spec.name, spec.wire, args.timeout, spec.retries)
        if args.retries is not None:
            spec = ClientSpec(spec.name, spec.wire, spec.timeout, args.retries)
        if not (args.silence or spec.timeout):
            raise SystemExit("--timeout 0 (the client's default) needs --silence")
        silence = args.silence or 3 * spec.timeout
        interval = args.interval or (spec.timeout or 300) / 3
        for kind in KINDS[spec.wire]:
            if args.kind and kind.name not in args.kind:
                continue
            outcome = await probe(clients, spec, kind, silence, interval,
                                  limit=args.limit or silence * (spec.retries + 2) + 60,
                                  auth=args.auth)
            print(outcome.row(), flush=True)
            if args.verbose:
                print(outcome.output[-2000:])
                print("    other requests:", outcome.others)
                for seen in outcome.seen:
                    print("   ", seen)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", action="append", choices=list(SPECS))
    parser.add_argument("--kind", action="append", help="only these keep-alive kinds")
    parser.add_argument("--silence", type=float, help="seconds of silence (3 timeouts)")
    parser.add_argument("--interval", type=float, help="seconds between keep-alives (timeout/3)")
    parser.add_argument("--timeout", type=float,
                        help="the client's idle timeout, seconds (0: leave its default)")
    parser.add_argument("--retries", type=int, help="resends allowed (2)")
    parser.add_argument("--limit", type=float, help="seconds a client run may take")
    parser.add_argument("--auth", choices=["token", "api-key", "helper"], default="token",
                        help="Claude Code's credential: ANTHROPIC_AUTH_TOKEN, "
                        "ANTHROPIC_API_KEY or an apiKeyHelper")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
