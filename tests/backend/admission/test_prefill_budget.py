"""The prefill budget's decisions, without I/O: which request goes next while a long cold
prompt is computed beside running streams, the batch band's aging, the engine a long
prompt goes to in a pool, and what the cache's knowledge takes off."""

from __future__ import annotations

from backend.admission.engine_queue import AdmissionQueue
from backend.admission.line import Line
from backend.admission.admission_registry import AdmissionRegistry
from backend.admission.flow import Band, Flow
from backend.admission.hint import Hint
from backend.admission.prefill_budget import (LONG_PREFILL_TOKENS, PREFILL_BUDGET, PrefillBudget)
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.port.metrics import Metrics
from tests.backend.admission_helpers import NEW, OLD, FakeClock

LONG = TokenNeed(prompt=6_000, output=200)
SHORT = TokenNeed(prompt=40, output=200)
ALICE = Flow("alice")
BOB = Flow("bob")
CAROL = Flow("carol")
NIGHTLY = Flow("nightly", band=Band.BATCH)


def engine(line: Line, url: str = OLD, slots: int = 4) -> AdmissionQueue:
    return AdmissionQueue(Serving(url, slots, kv=KvCapacity.split(slots * 8_192, slots)),
                          line=line)


def test_a_second_long_prompt_waits_while_the_first_is_computed_beside_a_stream():
    clock = FakeClock()
    line: Line[AdmissionQueue] = Line(clock=clock)
    engine(line)
    stream = line.request(SHORT, flow=ALICE)
    first = line.request(LONG, flow=BOB)
    second = line.request(LONG, flow=CAROL)

    assert stream.admitted and first.admitted
    assert not second.admitted and second.wait_reason == PREFILL_BUDGET

    first.prefilled()  # the engine sent its first bytes: the prompt is computed

    assert second.admitted and second.wait_reason == PREFILL_BUDGET  # why it waited


def test_a_short_request_passes_a_long_one_the_budget_holds():
    line: Line[AdmissionQueue] = Line(clock=FakeClock())
    engine(line)
    line.request(SHORT, flow=ALICE)
    line.request(LONG, flow=BOB)
    held = line.request(LONG, flow=CAROL)
    short = line.request(SHORT, flow=Flow("dave"))

    assert not held.admitted and short.admitted


def test_long_prompts_run_together_when_no_stream_would_feel_it():
    line: Line[AdmissionQueue] = Line(clock=FakeClock())
    engine(line)
    first, second = line.request(LONG, flow=ALICE), line.request(LONG, flow=BOB)
    assert first.admitted and second.admitted


def test_the_held_prompt_goes_when_the_long_one_ends_even_without_a_first_byte():
    line: Line[AdmissionQueue] = Line(clock=FakeClock())
    engine(line)
    line.request(SHORT, flow=ALICE)
    first = line.request(LONG, flow=BOB)
    second = line.request(LONG, flow=CAROL)
    first.release()  # a non-streamed answer, or the client left
    assert second.admitted


def test_a_batch_band_long_prompt_waits_beside_streams_until_it_has_aged():
    clock = FakeClock()
    line: Line[AdmissionQueue] = Line(clock=clock, aging=30.0)
    engine(line)
    stream = line.request(SHORT, flow=ALICE)
    nightly = line.request(LONG, flow=NIGHTLY)
    assert stream.admitted and not nightly.admitted
    assert nightly.wait_reason == PREFILL_BUDGET

    clock.now += 29.0
    line.admit_waiting()
    assert not nightly.admitted

    clock.now += 1.0
    line.admit_waiting()  # aged: it counts as the band above, so it is never starved
    assert nightly.admitted


def test_a_batch_band_long_prompt_goes_at_once_on_an_engine_without_streams():
    line: Line[AdmissionQueue] = Line(clock=FakeClock())
    engine(line)
    line.request(SHORT, flow=NIGHTLY)  # batch work decoding: nobody interactive feels it
    assert line.request(LONG, flow=NIGHTLY).admitted


def test_in_a_pool_a_long_prompt_goes_to_the_engine_with_the_fewest_running_streams():
    line: Line[AdmissionQueue] = Line(clock=FakeClock())
    big = engine(line, OLD, slots=8)  # the most free slots: where it would go otherwise
    small = engine(line, NEW, slots=3)
    for flow in (ALICE, BOB, CAROL):
        line.request(SHORT, flow=flow)
    assert (big.free_slots, small.free_slots) == (5, 3)  # all three on the big one

    long = line.request(LONG, flow=Flow("erin"))
    assert long.admitted and long.engine is small

    short = line.request(SHORT, flow=Flow("frank"))
    assert short.engine is big  # anything else: the line's own policy


def test_in_a_pool_a_long_prompt_skips_the_engine_already_computing_one():
    line: Line[AdmissionQueue] = Line(clock=FakeClock())
    first_engine = engine(line, OLD)
    second_engine = engine(line, NEW)
    line.request(SHORT, flow=ALICE)
    line.request(SHORT, flow=BOB)  # one stream on each
    first = line.request(LONG, flow=CAROL)
    second = line.request(LONG, flow=Flow("dave"))
    assert first.admitted and second.admitted
    assert {first.engine, second.engine} == {first_engine, second_engine}


def test_what_the_cache_holds_does_not_count_as_prefill():
    class PrefixCached:
        def cached_tokens(self, hint: Hint, engine: object) -> int:
            return 5_900 if hint.session == "alice\nagent" else 0

    budget = PrefillBudget(cache=PrefixCached())
    line: Line[AdmissionQueue] = Line(clock=FakeClock())
    line.prefill_budget.cache = budget.cache
    engine(line)
    line.request(SHORT, flow=ALICE)
    line.request(LONG, flow=BOB)
    warm = line.request(LONG, flow=ALICE, hint=Hint(session="alice\nagent"))
    cold = line.request(LONG, flow=CAROL)
    assert warm.admitted and not cold.admitted
    assert budget.uncached(warm, None) == LONG.prompt - 5_900 < LONG_PREFILL_TOKENS


def test_held_requests_show_in_the_metrics_as_a_wait_reason():
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 4, kv=KvCapacity.split(4 * 8_192, 4)))
    metrics = Metrics()
    metrics.bind_registry(registry)
    queue.line.request(SHORT, flow=ALICE)
    queue.line.request(LONG, flow=BOB)
    held = queue.line.request(LONG, flow=CAROL)
    assert metrics.value("gguf_studio_requests_waiting_by_reason",
                         {"reason": PREFILL_BUDGET}) == 1
    held.release()
    assert metrics.value("gguf_studio_requests_waiting_by_reason",
                         {"reason": PREFILL_BUDGET}) == 0
