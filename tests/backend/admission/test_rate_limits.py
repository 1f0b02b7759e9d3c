"""Tokens per minute and per day: exact waits, settlement, and what the SDKs read."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from openai.types.chat import ChatCompletion

from backend.errors import RateLimitExceeded
from backend.keys.key_store import KeyRecord
from backend.port.http_errors import http_error
from backend.admission.rate_limits import DAY, RateLimiter, TokenLimits, go_duration
from tests.not_none import not_none

T0 = 1_750_000_040.0  # 20 s into a minute


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def refused(limiter: RateLimiter, key: str, limits: TokenLimits, tokens: int) -> RateLimitExceeded:
    with pytest.raises(RateLimitExceeded) as caught:
        limiter.reserve(key, limits, tokens)
    return caught.value


# --- tokens per minute: a token bucket -------------------------------------------------------


def test_a_minutes_worth_may_burst_then_the_wait_is_exactly_the_missing_tokens():
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TokenLimits(per_minute=6000)  # refills 100 tokens a second
    limiter.reserve("alice", limits, 6000)
    error = refused(limiter, "alice", limits, 1000)
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert error.reason == "tokens_per_minute"
    assert error.retry_after == pytest.approx(10.0)
    assert "key 'alice' on tokens per minute" in str(error)
    assert "Please try again in 10s." in str(error)
    assert error.headers == {"x-ratelimit-limit-tokens": "6000",
                             "x-ratelimit-remaining-tokens": "0",
                             "x-ratelimit-reset-tokens": "1m0s",
                             "retry-after-ms": "10000"}
    clock.now += 9.99
    assert refused(limiter, "alice", limits, 1000).retry_after == pytest.approx(0.01)
    clock.now += 0.01
    limiter.reserve("alice", limits, 1000)


def test_the_wait_the_refusal_gives_is_exact_whatever_the_state():
    """Retrying exactly when told always fits; a millisecond earlier never does."""
    rng = random.Random(18)
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TokenLimits(per_minute=7919)
    checked = 0
    for _ in range(500):
        clock.now += rng.uniform(0, 3)
        tokens = rng.randint(1, 7919)
        try:
            reservation = limiter.reserve("k", limits, tokens)
        except RateLimitExceeded as error:
            checked += 1
            assert error.retry_after is not None and error.retry_after > 0
            if error.retry_after > 0.002:
                clock.now += error.retry_after - 0.001
                refused(limiter, "k", limits, tokens)
                clock.now += 0.001
            else:
                clock.now += error.retry_after
            reservation = limiter.reserve("k", limits, tokens)
        limiter.settle(reservation, rng.randint(0, tokens))
    assert checked > 100


def test_what_a_request_did_not_use_is_given_back_at_once():
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TokenLimits(per_minute=6000)
    reservation = limiter.reserve("bob", limits, 6000)  # a 2,048-token output budget...
    limiter.settle(reservation, 1500)                    # ...that stopped early
    assert limiter.headers("bob", limits)["x-ratelimit-remaining-tokens"] == "4500"
    limiter.settle(reservation, 0)  # a second settle changes nothing
    assert limiter.headers("bob", limits)["x-ratelimit-remaining-tokens"] == "4500"
    limiter.reserve("bob", limits, 4500)
    assert refused(limiter, "bob", limits, 1).retry_after == pytest.approx(0.01)


def test_using_more_than_reserved_is_charged_and_a_refund_never_overfills():
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TokenLimits(per_minute=6000)
    over = limiter.reserve("carol", limits, 1000)
    limiter.settle(over, 3000)
    assert limiter.headers("carol", limits)["x-ratelimit-remaining-tokens"] == "3000"
    late = limiter.reserve("carol", limits, 3000)
    clock.now += 60  # the bucket is full again before this one settles
    limiter.settle(late, 0)
    assert limiter.headers("carol", limits) == {"x-ratelimit-limit-tokens": "6000",
                                                "x-ratelimit-remaining-tokens": "6000",
                                                "x-ratelimit-reset-tokens": "0s"}


def test_a_request_larger_than_the_limit_is_told_a_retry_cannot_help():
    limiter = RateLimiter(Clock())
    error = refused(limiter, "dave", TokenLimits(per_minute=4000), 6000)
    assert error.retry_after is None
    assert error.headers["x-should-retry"] == "false"
    assert "retry-after-ms" not in error.headers
    assert "Request too large for key 'dave'" in str(error) and "6,000" in str(error)
    # ...and it cost the key nothing.
    limiter.reserve("dave", TokenLimits(per_minute=4000), 4000)


def test_a_limit_changed_on_the_key_applies_to_the_next_request():
    clock = Clock()
    limiter = RateLimiter(clock)
    limiter.reserve("erin", TokenLimits(per_minute=6000), 5000)
    refused(limiter, "erin", TokenLimits(per_minute=6000), 2000)
    limiter.reserve("erin", TokenLimits(per_minute=12000), 2000)  # raised by `keys edit`
    assert limiter.headers("erin", TokenLimits(per_minute=12000))[
        "x-ratelimit-remaining-tokens"] == "5000"


def test_a_key_without_limits_is_never_refused_and_gets_no_headers():
    limiter = RateLimiter(Clock())
    for _ in range(100):
        limiter.settle(limiter.reserve("owner", TokenLimits(), 1_000_000), 10)
    assert limiter.headers("owner", TokenLimits()) == {}


def test_keys_have_their_own_windows():
    limiter = RateLimiter(Clock())
    limits = TokenLimits(per_minute=1000)
    limiter.reserve("a", limits, 1000)
    refused(limiter, "a", limits, 1)
    limiter.reserve("b", limits, 1000)


# --- tokens per day: a sliding 24-hour window ---------------------------------------------------


def test_a_spent_day_frees_when_its_oldest_tokens_are_a_day_old():
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TokenLimits(per_day=10_000)
    limiter.reserve("frank", limits, 8000)          # at T0 (minute 0, 20 s in)
    clock.now = T0 + 3600
    limiter.reserve("frank", limits, 1000)
    clock.now = T0 + 7200
    error = refused(limiter, "frank", limits, 2000)
    freed = (T0 - 20) + 60 + DAY   # the end of T0's minute, a day later
    assert error.reason == "tokens_per_day"
    assert error.retry_after == pytest.approx(freed - clock.now)
    assert "Daily token budget reached for key 'frank'" in str(error)
    assert "used 9,000 in the last 24 hours, requested 2,000" in str(error)
    assert "free up again in about 22 h" in str(error)
    assert "Please try again" not in str(error)  # no agent sleeps 22 h in one retry
    assert error.headers["x-ratelimit-remaining-tokens"] == "1000"
    assert error.headers["x-ratelimit-reset-tokens"] == go_duration(T0 + 3600 - 20 + 60 + DAY - clock.now)
    clock.now = freed - 0.001
    refused(limiter, "frank", limits, 2000)
    clock.now = freed
    limiter.reserve("frank", limits, 2000)


def test_a_key_never_gets_more_than_its_budget_in_any_24_hours():
    rng = random.Random(5)
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TokenLimits(per_day=50_000)
    granted: list[tuple[float, int]] = []
    refusals = 0
    for _ in range(3000):
        clock.now += rng.expovariate(1 / 90)  # about three days in all
        tokens = rng.randint(1, 4000)
        try:
            reservation = limiter.reserve("g", limits, tokens)
        except RateLimitExceeded:
            refusals += 1
            continue
        used = rng.randint(0, tokens)
        limiter.settle(reservation, used)
        granted.append((clock.now, used))
    assert refusals > 100
    for end, _ in granted:
        in_day = sum(used for at, used in granted if end - DAY < at <= end)
        assert in_day <= 50_000


def test_refunds_reach_the_day_window_too():
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TokenLimits(per_day=10_000)
    reservation = limiter.reserve("h", limits, 9000)
    clock.now += 600
    limiter.settle(reservation, 2000)
    limiter.reserve("h", limits, 8000)
    refused(limiter, "h", limits, 1)


def test_with_both_limits_the_later_window_is_the_one_named():
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TokenLimits(per_minute=6000, per_day=8000)
    limiter.reserve("i", limits, 6000)
    error = refused(limiter, "i", limits, 1000)
    assert error.reason == "tokens_per_minute"  # the day has room; the minute frees in 10 s
    clock.now += 60
    limiter.reserve("i", limits, 2000)
    error = refused(limiter, "i", limits, 1000)
    assert error.reason == "tokens_per_day" and not_none(error.retry_after) > 80_000
    # Headers describe the window with less room: the day's 0 left, not the minute's 4000.
    assert limiter.headers("i", limits)["x-ratelimit-limit-tokens"] == "8000"
    assert limiter.headers("i", limits)["x-ratelimit-remaining-tokens"] == "0"


def test_a_restart_does_not_hand_a_key_a_fresh_day():
    clock = Clock()
    before = RateLimiter(clock)
    limits = TokenLimits(per_day=10_000)
    before.reserve("j", limits, 9000)
    clock.now += 3600
    after = RateLimiter(clock)
    minute_start = T0 - 20
    after.preload("j", [(minute_start, 9000), (minute_start - DAY - 120, 50_000)])
    error = refused(after, "j", limits, 2000)
    assert error.retry_after == pytest.approx(minute_start + 60 + DAY - clock.now)


# --- what clients read ------------------------------------------------------------------------


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.0004, "1ms"), (0.02, "20ms"), (0.999, "999ms"), (1, "1s"), (1.5, "1.5s"),
    (59.678, "59.678s"), (360, "6m0s"), (61.25, "1m1.25s"), (3600, "1h0m0s"),
    (86_460, "24h1m0s"),
])
def test_reset_times_are_written_as_openai_writes_them(seconds, text):
    assert go_duration(seconds) == text


def test_limits_are_read_from_the_key():
    record = KeyRecord(name="k", tokens_per_minute=100, tokens_per_day=None)
    assert TokenLimits.of(record) == TokenLimits(per_minute=100, per_day=None)


class _RateLimitedServer:
    """A minimal HTTP server answering chat completions through a real RateLimiter and
    the port's real error rendering; only what the SDK sees of the port is needed here."""

    def __init__(self, limiter: RateLimiter, limits: TokenLimits, tokens: int) -> None:
        self.arrivals: list[float] = []
        self.waits: list[float | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                outer.arrivals.append(time.monotonic())
                try:
                    limiter.reserve("sdk", limits, tokens)
                except RateLimitExceeded as error:
                    outer.waits.append(error.retry_after)
                    status, headers, body = http_error(error, None, error.headers)
                else:
                    body = json.dumps({
                        "id": "x", "object": "chat.completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "hi"}}],
                    }).encode()
                    status, headers = 200, [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name.decode(), value.decode())
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> openai.OpenAI:
        self.thread.start()
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.server.server_port}/v1",
                             api_key="gs-test", max_retries=2)

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _ask(client: openai.OpenAI) -> ChatCompletion:
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_the_openai_sdk_waits_exactly_the_keys_retry_after_then_gets_through():
    limiter = RateLimiter()
    limits = TokenLimits(per_minute=60_000)  # 1,000 tokens a second
    limiter.reserve("sdk", limits, 60_000)
    server = _RateLimitedServer(limiter, limits, tokens=1600)  # about 1.6 s short
    with server as client:
        answer = _ask(client)
    assert answer.choices[0].message.content == "hi"
    assert len(server.arrivals) == 2
    [wait] = server.waits
    # Without the header the SDK's first back-off would be at most 0.5 s.
    assert wait is not None and wait > 1
    assert server.arrivals[1] - server.arrivals[0] >= wait - 0.005


def test_the_openai_sdk_does_not_retry_a_spent_day_and_shows_which_limit():
    limiter = RateLimiter()
    limits = TokenLimits(per_day=1000)
    limiter.reserve("sdk", limits, 1000)
    server = _RateLimitedServer(limiter, limits, tokens=10)
    with server as client, pytest.raises(openai.RateLimitError) as caught:
        _ask(client)
    assert len(server.arrivals) == 1
    assert caught.value.code == "rate_limit_exceeded"
    assert "Daily token budget reached for key 'sdk'" in caught.value.message
    assert caught.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(caught.value.response.headers["retry-after"]) > 86_000


def test_the_openai_sdk_does_not_retry_a_request_too_large_for_the_key():
    limiter = RateLimiter()
    server = _RateLimitedServer(limiter, TokenLimits(per_minute=100), tokens=500)
    with server as client, pytest.raises(openai.RateLimitError, match="Request too large"):
        _ask(client)
    assert len(server.arrivals) == 1
