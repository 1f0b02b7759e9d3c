"""What an engine's own API says, read: which kind of upstream answered, and what it serves."""

from __future__ import annotations

import pytest

from backend.llama.api import StudioHealth
from backend.llama.kv_capacity import KvCapacity

STUDIO_READY = {"state": "ready", "model": "coder", "effective_parallel_slots": 4, "active": 1,
                "waiting": 0, "kv": {"total": 16384, "per_request": 8192, "unified": True, "reserved": 2100},
                "engine": None}


def test_a_gguf_studio_health_reads_as_its_model_slots_and_exact_cache():
    health = StudioHealth.read(STUDIO_READY)
    assert health == StudioHealth("ready", "coder", 4, KvCapacity(16384, 8192, unified=True), active=1)
    assert health.ready


def test_a_gguf_studio_port_without_a_model_is_told_apart_but_not_ready():
    health = StudioHealth.read({"state": "stopped", "model": None, "effective_parallel_slots": None,
                                "active": 0, "waiting": 0, "kv": None, "engine": None})
    assert health is not None and not health.ready


@pytest.mark.parametrize("body", [{"status": "ok"}, {"error": {"code": 503, "message": "Loading model"}},
                                  None, "ok", [1, 2]])
def test_llama_servers_health_is_not_taken_for_a_gguf_studio_port(body):
    assert StudioHealth.read(body) is None


def _engine(slots: int, total: int, per_request: int, unified: bool, state: str = "ready") -> dict:
    return {"id": "x", "where": "this machine", "state": state, "slots": slots,
            "kv": {"total": total, "per_request": per_request, "unified": unified},
            "active": 0, "waiting": 0, "reserved_tokens": 0, "note": None}


def _model(name: str, state: str, *engines: dict, **fields: object) -> dict:
    return {"id": name, "state": state, "default": False, "context_length": 2048, "aliases": [],
            "local": True, "pinned": False, "idle_ttl": 0.0, "embeddings": False,
            "decision": "", "error": None, "engines": list(engines), **fields}


def test_a_gguf_studio_health_lists_every_model_with_its_state_and_engines():
    health = StudioHealth.read(dict(STUDIO_READY, models=[
        _model("coder", "ready", _engine(4, 16384, 8192, True), default=True, aliases=["c"]),
        _model("small", "unloaded", embeddings=True),
        _model("broken", "failed", error="It did not load."),
    ]))
    assert health is not None and health.models is not None
    coder, small, broken = health.models
    assert (coder.id, coder.state, coder.default, coder.aliases) == ("coder", "ready", True, ("c",))
    assert (coder.slots, coder.kv) == (4, KvCapacity(16384, 8192, unified=True))
    assert (small.slots, small.kv, small.loadable, small.embeddings) == (None, None, True, True)
    assert (broken.loadable, broken.error) == (False, "It did not load.")


def test_a_model_on_several_engines_is_their_slots_and_tokens_together():
    """That port routes a request to whichever of its engines has room: together they
    run the sum of their slots; split caches of one share per slot stay split."""
    split = StudioHealth.read(dict(STUDIO_READY, models=[
        _model("m", "ready", _engine(2, 4096, 2048, False), _engine(3, 6144, 2048, False))]))
    assert split is not None and split.models is not None
    assert (split.models[0].slots, split.models[0].kv) == (5, KvCapacity(10240, 2048, unified=False))
    mixed = StudioHealth.read(dict(STUDIO_READY, models=[
        _model("m", "ready", _engine(2, 4096, 2048, False), _engine(1, 8192, 8192, True),
               _engine(4, 4096, 1024, False, state="restarting"))]))
    assert mixed is not None and mixed.models is not None
    # The restarting engine counts for nothing; the others as one pool, each request up to
    # the larger limit (that port puts it where it fits).
    assert (mixed.models[0].slots, mixed.models[0].kv) == (3, KvCapacity(12288, 8192, unified=True))


def test_a_model_with_an_engine_of_unknown_cache_is_counted_by_slots_alone():
    unknown = _engine(2, 4096, 2048, False)
    unknown["kv"] = None
    health = StudioHealth.read(dict(STUDIO_READY, models=[
        _model("m", "ready", _engine(2, 4096, 2048, False), unknown)]))
    assert health is not None and health.models is not None
    assert (health.models[0].slots, health.models[0].kv) == (4, None)


@pytest.mark.parametrize("state, local, loadable", [
    ("unloaded", True, True), ("evicted", True, True), ("loading", True, True),
    ("failed", True, False), ("unloading", True, False), ("ready", True, False),
    ("unloaded", False, False),  # served by that port's own upstream, which is out: nothing loads it
])
def test_only_a_model_that_port_loads_itself_on_demand_is_loadable(state, local, loadable):
    health = StudioHealth.read(dict(STUDIO_READY, models=[_model("m", state, local=local)]))
    assert health is not None and health.models is not None
    assert health.models[0].loadable is loadable
    assert health.models[0].slots is None  # no ready engine: no slots


def test_an_older_port_without_the_models_list_reads_as_before():
    health = StudioHealth.read(STUDIO_READY)
    assert health is not None and health.models is None


def test_unreadable_model_entries_are_left_out_and_odd_fields_read_safely():
    health = StudioHealth.read(dict(STUDIO_READY, models=[
        "coder", {"id": "", "state": "ready"}, {"id": "x"}, None,
        {"id": "odd", "state": "ready", "aliases": "a", "engines": [None, {"state": "ready",
                                                                           "slots": True, "kv": 5}],
         "context_length": -3}]))
    assert health is not None and health.models is not None
    (odd,) = health.models
    assert (odd.id, odd.aliases, odd.context_length, odd.slots, odd.kv) == ("odd", (), None, None, None)
