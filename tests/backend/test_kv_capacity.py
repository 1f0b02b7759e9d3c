"""The KV cache rules: an attached engine's cache, the plan before a load, and how it reads."""

from __future__ import annotations

import pytest

from backend.kv_capacity import KvCapacity, kv_from_props, planned_capacity


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
