"""Parked slots against the real engine: a prefix saved from one llama-server comes back
into a fresh one (its next reply computes almost nothing of it), a restore that cannot
take leaves the engine up and the request served, the files are private and per key."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import stat
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from backend.llama.api import engine_headers
from backend.llama.load import LoadSettings, Snapshot
from backend.llama.slot_actions import SlotActionFailed, SlotClient
from backend.llama.slot_parking import (INDEX_NAME, MIN_FREE_DISK_BYTES, ParkingLot, ParkKey,
                                        model_identity)
from backend.llama.supervisor import Supervisor, build_command
from backend.models.fit import KvShape
from backend.models.gguf_info import read_model_info

#: About 600 tokens of the tiny model's SentencePiece vocabulary.
PROMPT = " ".join(f"line {n}: the agent reads file number {n} and plans its next edit."
                  for n in range(40))
SETTINGS = LoadSettings(ctx_size=4096, parallel="2")


async def test_a_parked_prefix_restored_into_a_fresh_engine_is_not_computed_again(
        llama_server_binary, tmp_path, tiny_model):
    key = ParkKey(model_identity(tiny_model), flow="alice", session="codex-thread-1")
    slots = tmp_path / "slots"
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        first = await complete(engine, PROMPT, slot=0)
        async with slot_client(engine) as client:
            parked = await ParkingLot(slots).save(client, 0, key, prompt=PROMPT,
                                                  token_bytes=kv_bytes(tiny_model))
    assert first["prompt_n"] > 500 and parked.tokens >= first["prompt_n"]

    # A new engine (another process, as after an unload or a restart of the app) and a
    # lot that knows the file only from the index on disk.
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        cold = await complete(engine, PROMPT + " And one more line.", slot=1)
        async with slot_client(engine) as client:
            restored = await ParkingLot(slots).restore(client, 0, key)
        warm = await complete(engine, PROMPT + " And one more line.", slot=0)
    assert restored is not None and restored.tokens == parked.tokens
    assert cold["cache_n"] == 0  # what an engine without the parked file computes
    prompt = warm["cache_n"] + warm["prompt_n"]
    assert warm["cache_n"] >= 0.95 * first["prompt_n"] and warm["prompt_n"] <= 0.05 * prompt
    assert restored.took(warm["cache_n"]) and not restored.took(cold["cache_n"])


async def test_a_restore_that_does_not_take_leaves_the_engine_up_and_the_turn_is_served(
        llama_server_binary, tmp_path, tiny_model, smollm2_model):
    tiny_key = ParkKey(model_identity(tiny_model), flow="alice", session="s")
    smol_key = ParkKey(model_identity(smollm2_model), flow="alice", session="s")
    slots = tmp_path / "slots"
    lot = ParkingLot(slots)
    async with running(llama_server_binary, tmp_path / "smol", smollm2_model, slots) as smol:
        await complete(smol, PROMPT, slot=0)
        async with slot_client(smol) as client:
            await lot.save(client, 0, smol_key, prompt=PROMPT, token_bytes=kv_bytes(smollm2_model))
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        await complete(engine, PROMPT, slot=0)
        async with slot_client(engine) as client:
            await lot.save(client, 0, tiny_key, prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
        # Another model's KV under this model's name, its index entry made to match it
        # (the checks before the engine pass): the engine refuses to read it.
        forge_entry(slots, tiny_key.file_name, slots / smol_key.file_name)
        async with slot_client(engine) as client:
            foreign = await ParkingLot(slots).restore(client, 0, tiny_key)
        after_foreign = await complete(engine, PROMPT, slot=0)

        # A file cut short (a disk that filled up, a copy interrupted): the pinned
        # llama.cpp aborts on one, so it never reaches the engine.
        await complete(engine, PROMPT, slot=1)
        async with slot_client(engine) as client:
            await lot.save(client, 1, tiny_key, prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
        path = slots / tiny_key.file_name
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
        async with slot_client(engine) as client:
            truncated = await lot.restore(client, 1, tiny_key)
        after_truncated = await complete(engine, PROMPT + " More.", slot=1)
        healthy = await answers_health(engine)
    assert foreign is None and truncated is None and healthy
    # The refused restore emptied the slot: the turn computed its whole prompt, and got
    # its answer.
    assert after_foreign["cache_n"] == 0 and after_foreign["prompt_n"] > 500
    # The truncated file was not read: slot 1 still holds what it held (the turn reused it).
    assert after_truncated["cache_n"] > 500
    # A file that did not take is gone, not tried again on the next turn.
    assert lot.find(tiny_key) is None and not path.exists()
    assert ParkingLot(slots).find(smol_key) is not None


async def test_parked_files_are_private_digest_named_and_only_their_own_keys(
        llama_server_binary, tmp_path, tiny_model, loose_umask):
    model = model_identity(tiny_model)
    alice = ParkKey(model, flow="alice", session="thread-42")
    bob = ParkKey(model, flow="bob", session="thread-42")  # the same session name
    slots = tmp_path / "slots"
    lot = ParkingLot(slots)
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        await complete(engine, PROMPT, slot=0)
        async with slot_client(engine) as client:
            await lot.save(client, 0, alice, prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
            assert await lot.restore(client, 1, bob) is None
        bobs_turn = await complete(engine, PROMPT, slot=1)
    assert bobs_turn["cache_n"] == 0  # nothing of alice's prefix reached bob's slot
    assert lot.find(bob) is None and lot.find(alice) is not None
    assert stat.S_IMODE(slots.stat().st_mode) == 0o700
    names = sorted(p.name for p in slots.iterdir())
    assert names == sorted([INDEX_NAME, alice.file_name])
    for name in names:
        assert stat.S_IMODE((slots / name).stat().st_mode) == 0o600
        assert "alice" not in name and "thread" not in name
    index = (slots / INDEX_NAME).read_text()
    assert "alice" not in index and "thread-42" not in index and str(tiny_model) not in index

    # A file of alice's put under bob's name, with an index entry for it, still says
    # alice's key: bob's request does not get it.
    shutil.copyfile(slots / alice.file_name, slots / bob.file_name)
    data = json.loads(index)
    data["parked"].append(dict(data["parked"][0], file=bob.file_name))
    (slots / INDEX_NAME).write_text(json.dumps(data))
    assert ParkingLot(slots).find(bob) is None

async def test_past_the_disk_budget_the_least_recently_used_prefix_goes(
        llama_server_binary, tmp_path, tiny_model):
    model = model_identity(tiny_model)
    keys = [ParkKey(model, flow="alice", session=f"s{n}") for n in range(3)]
    slots = tmp_path / "slots"
    budget = [1 << 40]
    lot = ParkingLot(slots, budget=lambda: budget[0])
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        await complete(engine, PROMPT, slot=0)
        async with slot_client(engine) as client:
            first = await lot.save(client, 0, keys[0], prompt=PROMPT,
                                   token_bytes=kv_bytes(tiny_model))
            await lot.save(client, 0, keys[1], prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
            await lot.restore(client, 1, keys[0])  # keys[0] used again: keys[1] is older
            budget[0] = 2 * first.size + first.size // 2
            await lot.save(client, 0, keys[2], prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
    assert [lot.find(k) is not None for k in keys] == [True, False, True]
    assert lot.used_bytes <= budget[0]
    assert not (slots / keys[1].file_name).exists()


async def test_a_slot_larger_than_the_budget_is_not_saved_and_costs_no_other_file(
        llama_server_binary, tmp_path, tiny_model):
    """The slot's size is known before the engine writes: a slot that cannot fit is not
    saved (before, it was saved, then every file evicted to make room for it, itself
    too)."""
    model = model_identity(tiny_model)
    small, large = ParkKey(model, "alice", "short"), ParkKey(model, "alice", "long")
    slots = tmp_path / "slots"
    budget = [1 << 40]
    lot = ParkingLot(slots, budget=lambda: budget[0])
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        await complete(engine, PROMPT[:150], slot=0)
        await complete(engine, PROMPT * 2, slot=1)
        async with slot_client(engine) as client:
            kept = await lot.save(client, 0, small, prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
            assert await client.slot_tokens(1) > 10 * kept.tokens
            budget[0] = 4 * kept.size  # a tenth of the long slot, or less
            with pytest.raises(SlotActionFailed, match="more than the 1 MiB parked prefixes"):
                await lot.save(client, 1, large, prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
    assert lot.find(small) == kept and lot.find(large) is None
    assert sorted(p.name for p in slots.iterdir()) == sorted([INDEX_NAME, small.file_name])


async def test_a_save_that_would_leave_the_disk_nearly_full_is_not_made(
        llama_server_binary, tmp_path, tiny_model):
    """The disk's free space is a stand-in here (this machine's disk cannot be filled
    for a test): the lot asks it before the engine writes."""
    model = model_identity(tiny_model)
    keys = [ParkKey(model, "alice", f"s{n}") for n in range(2)]
    slots = tmp_path / "slots"
    free = [1 << 40]
    lot = ParkingLot(slots, free_disk=lambda path: free[0])
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        await complete(engine, PROMPT, slot=0)
        async with slot_client(engine) as client:
            first = await lot.save(client, 0, keys[0], prompt=PROMPT,
                                   token_bytes=kv_bytes(tiny_model))
            free[0] = MIN_FREE_DISK_BYTES + first.size // 2
            with pytest.raises(SlotActionFailed, match="leaving less than 1024 MiB"):
                await lot.save(client, 0, keys[1], prompt=PROMPT)
            # Its own file replaced: the bytes it frees count.
            again = await lot.save(client, 0, keys[0], prompt=PROMPT)
    assert again.tokens == first.tokens and lot.find(keys[1]) is None
    assert sorted(p.name for p in slots.iterdir()) == sorted([INDEX_NAME, keys[0].file_name])


async def test_a_parked_prefix_unused_past_its_ttl_is_removed(
        llama_server_binary, tmp_path, tiny_model):
    model = model_identity(tiny_model)
    used, idle = ParkKey(model, "alice", "used"), ParkKey(model, "alice", "idle")
    slots = tmp_path / "slots"
    day = 24 * 3600.0
    now = [0.0]
    lot = ParkingLot(slots, ttl=lambda: 7 * day, clock=lambda: now[0])
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        await complete(engine, PROMPT, slot=0)
        async with slot_client(engine) as client:
            await lot.save(client, 0, used, prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
            await lot.save(client, 0, idle, prompt=PROMPT)
            now[0] = 6 * day
            assert await lot.restore(client, 1, used) is not None  # used again
    # A week and a day later, the app starts again: the file unused since is gone.
    later = ParkingLot(slots, ttl=lambda: 7 * day, clock=lambda: 8 * day)
    assert later.find(idle) is None and later.find(used) is not None
    assert not (slots / idle.file_name).exists()
    # Left running, a look past the TTL removes it too.
    now[0] = 13 * day + 1
    assert lot.find(used) is None and not (slots / used.file_name).exists()
    assert [p.name for p in slots.iterdir()] == [INDEX_NAME]


async def test_the_files_of_a_revoked_key_are_removed_and_no_one_elses(
        llama_server_binary, tmp_path, tiny_model):
    model = model_identity(tiny_model)
    alice = [ParkKey(model, "alice", f"s{n}") for n in range(2)]
    bob = ParkKey(model, "bob", "s0")
    slots = tmp_path / "slots"
    lot = ParkingLot(slots)
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        await complete(engine, PROMPT, slot=0)
        async with slot_client(engine) as client:
            for key in (*alice, bob):
                await lot.save(client, 0, key, prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
    assert lot.keep_flows({"bob", "owner"}) == 2
    assert [lot.find(k) for k in alice] == [None, None] and lot.find(bob) is not None
    assert sorted(p.name for p in slots.iterdir()) == sorted([INDEX_NAME, bob.file_name])
    assert ParkingLot(slots).find(bob) is not None  # the index says so after a restart


async def test_a_prefix_in_the_ram_cache_is_recalled_into_a_slot_and_parked(
        llama_server_binary, tmp_path, tiny_model):
    key = ParkKey(model_identity(tiny_model), flow="alice", session="moved-out")
    other = "Another agent's conversation. " + PROMPT
    slots = tmp_path / "slots"
    lot = ParkingLot(slots)
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        assert engine.serving is not None and engine.serving.pin_any_slot
        first = await complete(engine, PROMPT, slot=0)
        await complete(engine, other, slot=0)  # the slot changes hands: PROMPT goes to RAM
        async with slot_client(engine) as client:
            cached, computed = await client.recall(0, "/completion", json.dumps(
                {"prompt": PROMPT, "n_predict": 8, "stream": True}).encode())
            parked = await lot.save(client, 0, key, prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
    assert cached >= first["prompt_n"] - 1 and computed <= 1  # from the cache, not computed
    assert parked.tokens >= first["prompt_n"]

    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        async with slot_client(engine) as client:
            restored = await lot.restore(client, 1, key)
        warm = await complete(engine, PROMPT + " And one more line.", slot=1)
    assert restored is not None and restored.took(warm["cache_n"])
    assert warm["prompt_n"] <= 0.05 * (warm["prompt_n"] + warm["cache_n"])


async def test_a_responses_request_is_recalled_into_its_slot_too(
        llama_server_binary, tmp_path, tiny_model):
    """Codex's route: llama-server turns a Responses request into a chat one, keeping the
    slot and token fields the recall sets (its answer carries no timings)."""
    model = model_identity(tiny_model)
    request = {"model": "tiny", "input": PROMPT, "max_output_tokens": 8, "stream": True}
    slots = tmp_path / "slots"
    lot = ParkingLot(slots)
    async with running(llama_server_binary, tmp_path, tiny_model, slots) as engine:
        assert engine.serving is not None
        async with slot_client(engine) as client, httpx.AsyncClient(
                headers=engine_headers(engine.serving.api_key), timeout=120) as http:
            answer = await http.post(f"{engine.serving.base_url}/v1/responses",
                                     json={**request, "stream": False, "id_slot": 0})
            assert answer.status_code == 200, answer.text
            first = await lot.save(client, 0, ParkKey(model, "alice", "as answered"),
                                   prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
            await complete(engine, "Another agent's conversation. " + PROMPT, slot=0)
            await client.recall(0, "/v1/responses", json.dumps(request).encode())
            recalled = await lot.save(client, 0, ParkKey(model, "alice", "recalled"),
                                      prompt=PROMPT, token_bytes=kv_bytes(tiny_model))
    assert recalled.tokens >= first.tokens - 8  # its prompt, with one token of answer


def test_the_engine_is_started_with_the_parking_directory(tmp_path, tiny_model):
    spec = SETTINGS.to_spec(str(tiny_model))
    args = build_command(Path("llama-server"), spec, 8080, amx=False, slot_save_dir=tmp_path)
    assert args[args.index("--slot-save-path") + 1] == str(tmp_path)
    with pytest.raises(Exception, match="--slot-save-path"):
        LoadSettings(extra_args=("--slot-save-path", "/tmp")).validate()


# --- helpers -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(binary: Path, log_dir: Path, model: Path, slots: Path) -> AsyncIterator[Snapshot]:
    lot = ParkingLot(slots)
    supervisor = Supervisor(binary, log_dir, load_timeout=120, stop_timeout=5,
                            slot_save_dir=lot.open)
    try:
        yield await supervisor.load(SETTINGS.to_spec(str(model)))
    finally:
        await supervisor.unload()


@contextlib.asynccontextmanager
async def slot_client(engine: Snapshot) -> AsyncIterator[SlotClient]:
    assert engine.serving is not None
    async with SlotClient(engine.serving.base_url, api_key=engine.serving.api_key) as client:
        yield client


def kv_bytes(model: Path) -> int:
    """A token's KV bytes in `model`'s slots, as its header says (what the steward gives
    a save of a model with no file parked yet)."""
    shape = KvShape.from_model_info(read_model_info(model))
    assert shape is not None
    return shape.bytes_per_token


def forge_entry(slots: Path, name: str, source: Path) -> None:
    """Put `source` under parked name `name`, its index entry saying `source`'s size and
    digest."""
    shutil.copyfile(source, slots / name)
    data = json.loads((slots / INDEX_NAME).read_text())
    for entry in data["parked"]:
        if entry["file"] == name:
            entry["size"] = source.stat().st_size
            entry["sha256"] = hashlib.sha256(source.read_bytes()).hexdigest()
    (slots / INDEX_NAME).write_text(json.dumps(data))


async def answers_health(engine: Snapshot) -> bool:
    assert engine.serving is not None
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{engine.serving.base_url}/health")).status_code == 200


async def complete(engine: Snapshot, prompt: str, *, slot: int) -> dict[str, int]:
    """The engine's own timings of one short completion on `slot`: tokens it took from
    its cache (`cache_n`) and computed (`prompt_n`)."""
    assert engine.serving is not None
    async with httpx.AsyncClient(headers=engine_headers(engine.serving.api_key),
                                 timeout=120) as client:
        answer = await client.post(f"{engine.serving.base_url}/completion", json={
            "prompt": prompt, "n_predict": 2, "id_slot": slot, "cache_prompt": True,
            "temperature": 0})
    assert answer.status_code == 200, answer.text
    timings = answer.json()["timings"]
    return {"cache_n": timings["cache_n"], "prompt_n": timings["prompt_n"]}
