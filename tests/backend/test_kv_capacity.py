"""Reading the engine's KV cache from its load output, and the attached-engine rule."""

from __future__ import annotations

import pytest

from backend.kv_capacity import KvCapacity, KvLoadReader, kv_from_props, planned_capacity


def read(*lines: str) -> KvCapacity | None:
    reader = KvLoadReader()
    for line in lines:
        reader.feed(line)
    return reader.capacity()


INIT = "0.00.203.455 I srv    load_model: initializing, n_slots = {}, n_ctx_slot = {}, kv_unified = '{}'"


def test_a_split_cache_gives_each_slot_its_own_share():
    assert read(INIT.format(2, 8192, "false")) == KvCapacity(16384, 8192, unified=False)


def test_a_unified_pool_nothing_capped_is_one_slots_context():
    assert read("llama_server: initializing ...", INIT.format(4, 32768, "true")) == \
        KvCapacity(32768, 32768, unified=True)


def test_a_pool_larger_than_the_training_context_is_read_from_the_capping_warning():
    # The tiny test model, Auto slots, --ctx-size 16384 (captured from a real load).
    assert read(
        "0.00.186.836 W llama_context: n_ctx_seq (16384) > n_ctx_train (8192) -- possible "
        "training context overflow",
        "0.00.202.230 W srv    load_model: the slot context (16384) exceeds the training "
        "context of the model (8192) - capping",
        INIT.format(4, 8192, "true")) == KvCapacity(16384, 8192, unified=True)


def test_kv_unified_per_slot_caps_one_request_below_the_pool():
    assert read("I srv load_model: capping per-slot context (32768) to --kv-unified-per-slot (8192)",
                INIT.format(4, 8192, "true")) == KvCapacity(32768, 8192, unified=True)


def test_the_real_loads_context_wins_over_fits_dry_run():
    assert read("llama_context: n_ctx                 = 65536",  # --fit measuring
                "llama_context: n_ctx                 = 24576",  # the real load (verbosity 4)
                INIT.format(4, 24576, "true")) == KvCapacity(24576, 24576, unified=True)


def test_no_load_line_means_unknown():
    assert read("llama_server: model loaded") is None


@pytest.mark.parametrize("context", [None, 0])
def test_an_attached_engine_without_a_context_has_no_known_cache(context):
    assert kv_from_props(context) is None


def test_an_attached_engine_is_taken_as_one_pool_of_one_slots_context():
    # Safe whether it is split (each slot holds 4,096) or unified (a pool of >= 4,096).
    assert kv_from_props(4096) == KvCapacity(4096, 4096, unified=True)


def test_describe_says_what_the_choice_means():
    assert KvCapacity(16384, 8192, unified=True).describe(4) == \
        "up to 4 requests at once; each up to 8,192 tokens (one shared pool of 16,384)"
    assert KvCapacity.split(8192, 2).describe(2) == \
        "up to 2 requests at once; each up to 4,096 tokens (4,096 reserved for each)"


def test_auto_slots_plan_four_requests_sharing_one_pool_capped_by_training():
    assert planned_capacity(16384, "auto", 8192) == (4, KvCapacity(16384, 8192, unified=True))
    assert planned_capacity(0, "auto", 32768) == (4, KvCapacity(32768, 32768, unified=True))


def test_a_number_of_slots_plans_a_share_each():
    assert planned_capacity(16384, "2", 32768) == (2, KvCapacity(16384, 8192, unified=False))
    assert planned_capacity(2048, "2", 8192) == (2, KvCapacity(2048, 1024, unified=False))


def test_per_slot_cap_and_unknown_training_context():
    assert planned_capacity(32768, "auto", 32768, ("--kv-unified-per-slot", "8192")) == \
        (4, KvCapacity(32768, 8192, unified=True))
    assert planned_capacity(0, "auto", None) is None
