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
