"""The KV cache rules: an attached engine's cache, the plan before a load, and how it reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backend.models.gguf_info import read_model_info
from backend.errors import SettingsError
from backend.llama.kv_capacity import (KvCapacity, KvLayout, KvPlan, assumed_layout_note, context_args,
                                       kv_from_health, kv_from_props, planned_capacity)
from backend.llama.load import LoadSettings, State
from backend.llama.supervisor import Supervisor
from tests.not_none import not_none


@pytest.mark.parametrize("context", [None, 0])
def test_an_attached_engine_without_a_context_has_no_known_cache(context):
    assert kv_from_props(context) is None


def test_an_attached_engine_is_taken_as_one_pool_of_one_slots_context():
    # Safe whether it is split (each slot holds 4,096) or unified (a pool of >= 4,096).
    assert kv_from_props(4096) == KvCapacity(4096, 4096, unified=True)
    assert kv_from_props(4096, slots=4) == KvCapacity(4096, 4096, unified=True)


def test_a_stated_split_gives_every_slot_its_own_share():
    assert kv_from_props(4096, slots=4, layout=KvLayout.SPLIT) == KvCapacity(16384, 4096, unified=False)


def test_a_stated_unified_cache_is_one_pool_of_one_slots_context():
    # Unified, a slot's context is the pool (unless --kv-unified-per-slot caps it).
    assert kv_from_props(16384, slots=4, layout=KvLayout.UNIFIED) == KvCapacity(16384, 16384, unified=True)


def test_the_assumption_is_named_only_where_it_may_hold_requests_back():
    assumed = not_none(kv_from_props(4096, slots=4))
    assert assumed_layout_note(assumed, 4, None) == (
        "KV layout unknown: assuming one shared pool of 4,096 tokens; this limits concurrency — "
        "state split or unified for this upstream.")
    assert assumed_layout_note(assumed, 1, None) is None  # one slot: both layouts are the same
    assert assumed_layout_note(assumed, 4, KvLayout.UNIFIED) is None


@pytest.mark.parametrize("text, layout", [("split", KvLayout.SPLIT), (" Unified ", KvLayout.UNIFIED),
                                          ("", None), (None, None)])
def test_the_operators_statement_reads_as_a_layout(text, layout):
    assert KvLayout.parse(text) is layout


def test_a_statement_that_is_no_layout_is_refused_clearly():
    with pytest.raises(SettingsError, match="'split' or 'unified', not 'shared'"):
        KvLayout.parse("shared")


def test_another_ports_health_gives_its_exact_cache():
    assert kv_from_health({"total": 8192, "per_request": 2048, "unified": False, "reserved": 0}) == \
        KvCapacity(8192, 2048, unified=False)
    assert kv_from_health(KvCapacity(16384, 8192, unified=True).to_dict()) == KvCapacity(16384, 8192, True)


@pytest.mark.parametrize("data", [None, "8192", {"total": 8192, "per_request": 2048},
                                  {"total": 2048, "per_request": 8192, "unified": True},
                                  {"total": "8192", "per_request": 2048, "unified": True}])
def test_a_health_cache_that_does_not_read_as_one_is_none(data):
    assert kv_from_health(data) is None


def test_describe_says_what_the_choice_means():
    assert KvCapacity(16384, 8192, unified=True).describe(4) == \
        "up to 4 requests at once; each up to 8,192 tokens; one shared pool of 16,384 tokens"
    assert KvCapacity.split(8192, 2).describe(2) == \
        "up to 2 requests at once; each slot has its own 4,096 tokens"


def test_auto_slots_plan_four_requests_sharing_one_pool_capped_by_training():
    assert planned_capacity(16384, "auto", 8192) == KvPlan(4, KvCapacity(16384, 8192, unified=True))
    assert planned_capacity(0, "auto", 32768, fit=False) == \
        KvPlan(4, KvCapacity(32768, 32768, unified=True))


def test_auto_slots_share_one_pool_even_when_the_extra_arguments_say_otherwise():
    # server.cpp turns -np -1 into 4 slots and kv_unified after reading every argument.
    assert not_none(planned_capacity(4096, "auto", 8192, ("--no-kv-unified",))).kv.unified


def test_a_number_of_slots_plans_a_share_each():
    assert planned_capacity(16384, "2", 32768) == KvPlan(2, KvCapacity(16384, 8192, unified=False))
    assert planned_capacity(2048, "2", 8192) == KvPlan(2, KvCapacity(2048, 1024, unified=False))


def test_the_models_own_context_gives_each_split_slot_the_whole_trained_context():
    # The case: 4 slots, "Model's own" on an 8,192-token model; --fit on sizes
    # the cache for 4 streams of 8,192 (common/fit.cpp), not 4 shares of 2,048.
    plan = planned_capacity(0, "4", 8192, ("-c", "0"))  # -c 0 last: the whole context
    assert plan == KvPlan(4, KvCapacity(32768, 8192, unified=False))
    assert plan.describe() == "Up to 4 requests at once; each slot has its own 8,192 tokens."


def test_without_fit_the_models_own_context_is_cut_into_shares():
    # GPU layers "none" passes --fit off: llama_context takes the trained context in total.
    assert planned_capacity(0, "4", 8192, fit=False) == KvPlan(4, KvCapacity(8192, 2048, unified=False))
    assert not_none(planned_capacity(0, "4", 8192, ("--fit", "off"))).kv.per_request == 2048


def test_a_split_share_is_padded_to_256_and_capped_by_training():
    assert not_none(planned_capacity(4096, "3", 8192)).kv == KvCapacity(4608, 1536, unified=False)
    assert not_none(planned_capacity(16384, "1", 8192)).kv == KvCapacity(8192, 8192, unified=False)


def test_the_extra_arguments_win_over_the_window_like_on_the_engines_command_line():
    assert not_none(planned_capacity(0, "2", 8192, ("-c", "4096"))).kv == KvCapacity(4096, 2048, unified=False)
    assert not_none(planned_capacity(0, "2", 8192, ("--ctx-size=4096",))).kv.total == 4096
    assert not_none(planned_capacity(4096, "2", 8192, ("-kvu",))).kv == KvCapacity(4096, 4096, unified=True)
    assert not_none(planned_capacity(4096, "2", 8192, ("-kvu", "-no-kvu"))).kv.unified is False


def test_per_slot_cap_and_unknown_training_context():
    assert planned_capacity(32768, "auto", 32768, ("--kv-unified-per-slot", "8192")) == \
        KvPlan(4, KvCapacity(32768, 8192, unified=True))
    assert planned_capacity(0, "auto", None) is None
    assert planned_capacity(4096, "2", None) == KvPlan(2, KvCapacity(4096, 2048, unified=False))


def test_a_per_slot_cap_sizes_the_pool_only_when_the_context_is_left_to_fit():
    # `-c 0` alone asks for the full context; the --fit-ctx the app adds after it with
    # --fit on lifts that, and then server.cpp sizes the pool to slots x cap.
    cap = ("--kv-unified-per-slot", "1024")
    assert planned_capacity(0, "auto", 32768, cap) == KvPlan(4, KvCapacity(4096, 1024, unified=True))
    assert not_none(planned_capacity(0, "auto", 32768, cap, fit=False)).kv == \
        KvCapacity(32768, 1024, unified=True)
    assert not_none(planned_capacity(0, "auto", 32768, cap + ("-c", "0"))).kv == \
        KvCapacity(32768, 1024, unified=True)


def test_the_models_own_context_with_fit_on_is_a_most_the_engine_may_shrink():
    assert context_args(0, fit=True) == ["--ctx-size", "0", "--fit-ctx", "4096"]
    assert context_args(0, fit=False) == ["--ctx-size", "0"]
    assert context_args(4096, fit=True) == ["--ctx-size", "4096"]
    assert planned_capacity(0, "auto", 32768) == \
        KvPlan(4, KvCapacity(32768, 32768, unified=True), at_most=True, fit_floor=4096)
    plan = planned_capacity(0, "4", 8192)
    assert plan == KvPlan(4, KvCapacity(32768, 8192, unified=False), at_most=True, fit_floor=16384)
    assert plan.describe() == ("Up to 4 requests at once; each slot has up to 8,192 tokens "
                               "of its own. The engine may give less to fit the memory "
                               "(not below 16,384 tokens in total).")
    # A model trained on no more than the floor is never shrunk.
    assert not not_none(planned_capacity(0, "auto", 4096)).at_most


def test_a_fit_floor_in_the_extra_arguments_counts():
    plan = planned_capacity(0, "2", 8192, ("--fit-ctx", "1024"))
    assert plan == KvPlan(2, KvCapacity(16384, 8192, unified=False), at_most=True, fit_floor=2048)
    assert plan.describe() == ("Up to 2 requests at once; each slot has up to 8,192 tokens "
                               "of its own. The engine may give less to fit the memory "
                               "(not below 2,048 tokens in total).")
    assert not not_none(planned_capacity(0, "2", 8192, ("--fit-ctx", "1024"), fit=False)).at_most
    assert not not_none(planned_capacity(4096, "2", 8192, ("--fit-ctx", "1024"))).at_most


# --- the plan against the real engine -------------------------------------------------------
# Each case loads the tiny model (trained on 8,192 tokens) in a real llama-server through
# the Supervisor, exactly as the window's Load button does, and compares what the window
# promised before loading with what the engine then reported (Snapshot.kv).

GRID: list[tuple[str, int, tuple[str, ...]]] = [(parallel, ctx, extra)
        for parallel in ("auto", "2", "4")
        for ctx in (0, 4096, 16384)
        for extra in ((), ("--kv-unified",))]
EDGES: list[tuple[str, int, tuple[str, ...], str]] = [
    # GPU layers "none" starts it with --fit off: the trained context is cut into shares.
    ("4", 0, (), "none"),
    # -c in the extra arguments wins over the window's context.
    ("2", 0, ("-c", "4096"), "auto"),
    # A per-request cap on a shared pool.
    ("auto", 16384, ("--kv-unified-per-slot", "2048"), "auto"),
    # A context left to --fit: the pool is sized to slots x the cap; -c 0 last: the
    # whole trained context, capped per request.
    ("auto", 0, ("--kv-unified-per-slot", "1024"), "auto"),
    ("auto", 0, ("--kv-unified-per-slot", "1024", "-c", "0"), "auto"),
    # --fit may shrink the context: the plan gives the most ("up to"), which this
    # machine's memory holds, so the engine gives exactly that.
    ("2", 0, ("--fit-ctx", "1024"), "auto"),
    # Auto slots share one pool whatever --no-kv-unified says.
    ("auto", 4096, ("--no-kv-unified",), "auto"),
]


@pytest.fixture
async def supervisor(llama_server_binary: Path, tmp_path: Path):
    sup = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=60, stop_timeout=5)
    yield sup
    await sup.unload()


@pytest.mark.parametrize(("parallel", "ctx", "extra", "gpu_layers"),
                         [(p, c, e, "auto") for p, c, e in GRID] + EDGES,
                         ids=lambda v: (" ".join(v) or "no-extra-args") if isinstance(v, tuple) else str(v))
async def test_the_plan_shown_before_loading_is_what_the_engine_gives(
        supervisor, tiny_model, parallel, ctx, extra, gpu_layers):
    settings = LoadSettings(ctx_size=ctx, parallel=parallel, n_gpu_layers=gpu_layers,
                            extra_args=extra)
    trained = read_model_info(tiny_model).context_length
    plan = planned_capacity(ctx, parallel, trained, extra, fit=gpu_layers != "none")
    assert plan is not None

    snapshot = await supervisor.load(settings.to_spec(str(tiny_model)))

    assert snapshot.state is State.READY
    assert (snapshot.serving.slots, snapshot.serving.kv) == (plan.slots, plan.kv)
    # The two lines the window shows say the same thing (an "up to" plan says more).
    promised = settings.describe_plan(trained)
    gave = snapshot.describe_kv().removeprefix("Engine gave: ").capitalize()
    assert promised == gave or (plan.at_most and "up to" in promised)


async def test_when_fit_shrinks_the_models_own_context_the_engine_gives_less_than_the_plans_most(
        supervisor, tiny_model):
    # --fit measures against the host's total memory less a margin (--fit-target, MiB).
    # A first load prints what the full context would use; a margin that leaves 4 MiB
    # less than that makes --fit shrink the context, as it would on a machine that is short.
    # The batch is the user's own in both loads: the compute buffer it sizes is part of
    # what --fit projects, and the stall budget's batch (chosen from the engine's measured
    # speed) differed between two loads (768 and 1,024 tokens), and with it the projection.
    batch = ("--batch-size", "512", "--ubatch-size", "512")
    settings = LoadSettings(ctx_size=0, parallel="4", extra_args=batch)
    first = await supervisor.load(settings.to_spec(str(tiny_model)))
    used, total = map(int, not_none(re.search(r"projected to use (\d+) MiB of host memory vs\. (\d+) MiB",
                                              Path(first.log_path).read_text())).groups())
    short = LoadSettings(ctx_size=0, parallel="4",
                         extra_args=(*batch, "--fit-target", str(total - used + 4)))
    plan = planned_capacity(0, "4", 8192, short.extra_args)
    assert plan is not None and plan.at_most
    assert plan.describe().startswith("Up to 4 requests at once; each slot has up to 8,192 tokens")

    snapshot = await supervisor.load(short.to_spec(str(tiny_model)))

    assert snapshot.state is State.READY and snapshot.serving.kv is not None
    assert snapshot.engine.context_reduced_from == plan.kv.total == 32768
    assert plan.fit_floor <= snapshot.serving.kv.total < plan.kv.total
    assert snapshot.serving.kv.per_request < plan.kv.per_request and not snapshot.serving.kv.unified


def test_settings_accept_exactly_the_layouts_an_upstream_can_be_stated_as():
    from backend.settings import UPSTREAM_KV_LAYOUTS
    assert UPSTREAM_KV_LAYOUTS == tuple(layout.value for layout in KvLayout)
