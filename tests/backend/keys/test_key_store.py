"""Named keys: hashed secrets, a private file, live changes, expiry and revocation."""

from __future__ import annotations

import json
import re
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backend.errors import KeyExpired, KeyRevoked, KeyStoreError, Unauthorized
from backend.keys.key_store import OWNER, KeyStore, Priority, hash_secret
from tests.not_none import not_none

ROOT = Path(__file__).resolve().parents[3]
NOW = 1_750_000_000.0  # a fixed "wall clock" for expiry


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "config" / "gguf-studio" / "keys.json"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- secrets -------------------------------------------------------------------------


def test_a_new_key_works_once_and_its_secret_is_never_written(path):
    store = KeyStore(path)
    record, secret = store.add("alice", tokens_per_minute=10_000)
    assert secret.startswith("gs-") and len(secret) >= 40
    assert store.authenticate(secret) == record
    assert record.tokens_per_minute == 10_000
    text = path.read_text()
    assert secret not in text and secret[3:] not in text and secret[3:20] not in text
    assert hash_secret(secret) in text
    assert store.authenticate("gs-" + "x" * 43) is None
    assert store.authenticate("") is None


def test_every_key_gets_its_own_random_secret(path):
    store = KeyStore(path)
    secrets = {store.add(f"agent-{i}")[1] for i in range(20)}
    assert len(secrets) == 20
    assert {not_none(store.authenticate(s)).name for s in secrets} == {f"agent-{i}" for i in range(20)}


def test_the_owners_key_from_the_settings_has_every_model_and_no_limits(path):
    store = KeyStore(path, owner_secret="gs-the-owners-key")
    _, named = store.add("bob", models=("qwen",), tokens_per_day=1000)
    owner = store.authenticate("gs-the-owners-key")
    assert owner is OWNER and owner.is_owner
    assert owner.allows("any-model") and owner.tokens_per_minute is None \
        and owner.tokens_per_day is None and owner.max_concurrent is None
    assert not_none(store.authenticate(named)).name == "bob"
    store.set_owner_secret("gs-a-new-owner-key")
    assert store.authenticate("gs-the-owners-key") is None
    assert store.authenticate("gs-a-new-owner-key") is OWNER
    assert "gs-the-owners-key" not in path.read_text()


def test_allowed_models_are_names_or_patterns_and_none_means_all(path):
    store = KeyStore(path)
    everything, _ = store.add("all")
    some, _ = store.add("some", models=("qwen2.5-coder-7b", "llama-3*"))
    assert everything.allows("whatever")
    assert some.allows("qwen2.5-coder-7b") and some.allows("llama-3.1-8b")
    assert not some.allows("qwen2.5-coder-14b") and not some.allows("Llama-3.1-8b")


# --- the file ------------------------------------------------------------------------


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_the_keys_file_is_private_to_the_user(path, loose_umask):
    KeyStore(path).add("alice")
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_a_keys_file_left_readable_by_others_is_made_private_on_load(path, loose_umask):
    KeyStore(path).add("alice")
    os.chmod(path, 0o644)
    os.chmod(path.parent, 0o755)
    store = KeyStore(path)
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert [r.name for r in store.records()] == ["alice"]


def test_a_broken_keys_file_is_a_clear_error_at_start(path):
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(KeyStoreError, match="keys.json is not readable JSON"):
        KeyStore(path)
    path.write_text(json.dumps({"version": 1, "keys": [{"name": "x", "secret_sha256": "no"}]}))
    with pytest.raises(KeyStoreError, match="'x'.*unusable"):
        KeyStore(path)
    path.write_text(json.dumps({"version": 99, "keys": []}))
    with pytest.raises(KeyStoreError, match="another version"):
        KeyStore(path)


def test_no_file_yet_means_no_named_keys(path):
    store = KeyStore(path, owner_secret="gs-owner")
    assert store.records() == []
    assert store.authenticate("gs-owner") is OWNER
    assert not path.exists()


# --- live changes ------------------------------------------------------------------------


def test_a_running_port_sees_keys_added_and_revoked_by_another_process(path):
    clock = Clock()
    serving = KeyStore(path, check_interval=0.5, clock=clock)
    cli = KeyStore(path)
    record, secret = cli.add("carol")
    # A key it does not know sends the serving store to the file at once: a key made a
    # moment ago works on its first request...
    assert serving.authenticate(secret) == record
    # ...while a change to a known key is seen within 0.5 s.
    generation = serving.generation
    cli.revoke("carol")
    clock.now += 0.4
    assert serving.authenticate(secret) == record
    clock.now += 0.1
    with pytest.raises(KeyRevoked):
        serving.authenticate(secret)
    assert serving.generation == generation + 1


def test_looking_again_without_a_change_rereads_nothing(path):
    clock = Clock()
    cli = KeyStore(path)
    _, secret = cli.add("dave")
    serving = KeyStore(path, clock=clock)
    generation = serving.generation
    for _ in range(5):
        clock.now += 1
        assert serving.refresh() is False
        assert not_none(serving.authenticate(secret)).name == "dave"
    assert serving.generation == generation


def test_an_edit_from_another_process_applies_live(path):
    clock = Clock()
    cli = KeyStore(path)
    cli.add("erin", tokens_per_minute=1000)
    serving = KeyStore(path, clock=clock)
    cli.edit("erin", tokens_per_minute=5000, priority="batch", weight=2.5)
    clock.now += 1
    record = not_none(serving.get("erin"))
    assert (record.tokens_per_minute, record.priority, record.weight) == (5000, Priority.BATCH, 2.5)


def test_a_file_broken_while_serving_keeps_the_last_good_keys(path, caplog):
    clock = Clock()
    cli = KeyStore(path)
    _, secret = cli.add("frank")
    good = path.read_text()
    serving = KeyStore(path, clock=clock)
    path.write_text("{half a file")
    clock.now += 1
    assert not_none(serving.authenticate(secret)).name == "frank"
    assert "not readable JSON" in caplog.text
    # Nothing is written over a broken file (that would lose every key in it)...
    with pytest.raises(KeyStoreError, match="not readable JSON"):
        cli.add("grace")
    # ...and once it is mended, the next look picks it up.
    path.write_text(good)
    cli.add("grace")
    clock.now += 1
    assert [r.name for r in serving.records()] == ["frank", "grace"]


def test_two_processes_adding_keys_at_once_lose_none(path):
    program = ("import sys; from pathlib import Path; from backend.keys.key_store import KeyStore\n"
               "store = KeyStore(Path(sys.argv[1]))\n"
               "for i in range(15): store.add(f'{sys.argv[2]}-{i}')\n")
    runs = [subprocess.Popen([sys.executable, "-c", program, str(path), who], cwd=ROOT)
            for who in ("left", "right")]
    assert [run.wait(timeout=60) for run in runs] == [0, 0]
    names = {r.name for r in KeyStore(path).records()}
    assert names == {f"{who}-{i}" for who in ("left", "right") for i in range(15)}


# --- expiry and revocation --------------------------------------------------------------


def test_an_expired_key_is_refused_with_401_saying_so(path):
    wall = Clock(NOW)
    store = KeyStore(path, wall_clock=wall)
    _, secret = store.add("temp", expires_at=NOW + 3600)
    wall.now = NOW + 3599
    assert not_none(store.authenticate(secret)).name == "temp"
    wall.now = NOW + 3600
    with pytest.raises(KeyExpired, match="'temp' expired") as refused:
        store.authenticate(secret)
    assert isinstance(refused.value, Unauthorized) and refused.value.status == 401
    assert not_none(store.get("temp")).status(wall.now) == "expired"


def test_a_revoked_key_is_refused_and_stays_revoked(path):
    store = KeyStore(path)
    _, secret = store.add("leaked")
    store.revoke("leaked")
    with pytest.raises(KeyRevoked, match="'leaked' was revoked") as refused:
        store.authenticate(secret)
    assert refused.value.status == 401 and refused.value.code == "invalid_api_key"
    with pytest.raises(KeyStoreError, match="revoked and stays so"):
        store.edit("leaked", weight=2)
    with pytest.raises(KeyStoreError, match="already exists \\(revoked\\)"):
        store.add("leaked")


def test_a_waiting_request_can_ask_again_whether_its_key_still_holds(path):
    wall = Clock(NOW)
    store = KeyStore(path, wall_clock=wall)
    store.add("waiter", expires_at=NOW + 60)
    assert not_none(store.get("waiter")).refusal(wall.now) is None
    wall.now += 60
    assert isinstance(not_none(store.get("waiter")).refusal(wall.now), KeyExpired)
    store.edit("waiter", expires_at=None)
    store.revoke("waiter")
    assert isinstance(not_none(store.get("waiter")).refusal(wall.now), KeyRevoked)


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    ({"weight": 0}, "weight must be a number above 0"),
    ({"weight": -1.5}, "weight must be a number above 0"),
    ({"weight": float("nan")}, "weight must be a number above 0"),
    ({"tokens_per_minute": 0}, "tokens per minute must be a whole number"),
    ({"tokens_per_day": 2.5}, "tokens per day must be a whole number"),
    ({"max_concurrent": -1}, "max concurrent must be a whole number"),
    ({"priority": "urgent"}, "priority 'urgent' is not one of interactive, normal, batch"),
    ({"models": ("qwen", " ")}, "model name in the key's list is empty"),
    ({"expires_at": NOW - 1}, "is in the past"),
])
def test_unusable_limits_are_named_and_change_nothing(path, changes, message):
    store = KeyStore(path, wall_clock=Clock(NOW))
    store.add("kept", weight=1.0)
    before = path.read_bytes()
    with pytest.raises(KeyStoreError, match=message):
        store.edit("kept", **changes)
    with pytest.raises(KeyStoreError, match=message):
        store.add("new", **changes)
    assert path.read_bytes() == before


@pytest.mark.parametrize("name, message", [
    ("owner", "name of the owner's key"),
    ("Owner", "name of the owner's key"),
    ("has space", "not usable"),
    ("-dash", "not usable"),
    ("x" * 65, "not usable"),
    ("", "not usable"),
])
def test_unusable_names_are_refused(path, name, message):
    with pytest.raises(KeyStoreError, match=message):
        KeyStore(path).add(name)


def test_names_are_unique_whatever_their_case(path):
    store = KeyStore(path)
    store.add("Alice")
    with pytest.raises(KeyStoreError, match="'Alice' already exists; choose another name"):
        store.add("alice")
    assert store.edit("alice", weight=2).name == "Alice"
    assert store.revoke("ALICE").name == "Alice"
    assert [r.name for r in store.records()] == ["Alice"]


def test_editing_a_key_that_does_not_exist_or_the_owners_is_refused(path):
    store = KeyStore(path)
    with pytest.raises(KeyStoreError, match="no key named 'nobody'"):
        store.edit("nobody", weight=2)
    with pytest.raises(KeyStoreError, match="no key named 'nobody'"):
        store.revoke("nobody")
    with pytest.raises(KeyStoreError, match="owner's key is the one in the settings"):
        store.revoke("owner")
    store.add("x")
    with pytest.raises(KeyStoreError, match="no setting 'secret_hash'"):
        store.edit("x", secret_hash="0" * 64)


def hostile_files() -> list[Any]:
    """Hand edits that once escaped the store's checks as RecursionError or OverflowError."""
    entry = {"name": "mallory", "secret_sha256": "0" * 64}
    return [
        pytest.param('{"version": 1, "keys": ' + "[" * 100_000 + "]" * 100_000 + "}",
                     "nested too deep", id="deep-nesting"),
        pytest.param(json.dumps({"version": 1, "keys": [dict(entry, weight=10**400)]}),
                     "'mallory'.*unusable", id="weight-10**400"),
        pytest.param(json.dumps({"version": 1, "keys": [dict(entry, tokens_per_minute=10**400)]}),
                     "'mallory'.*unusable", id="tokens-10**400"),
    ]


@pytest.mark.parametrize("text, says", hostile_files())
def test_a_hostile_hand_edit_is_refused_readably_at_start(path, text, says):
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(KeyStoreError, match=says):
        KeyStore(path)


@pytest.mark.parametrize("text, says", hostile_files())
def test_a_hostile_hand_edit_while_serving_keeps_the_keys_working_and_says_why(path, caplog, text, says):
    clock = Clock()
    _, secret = KeyStore(path).add("frank")
    serving = KeyStore(path, clock=clock)
    path.write_text(text)
    clock.now += 1
    assert not_none(serving.authenticate(secret)).name == "frank"  # no 500: the last good keys
    assert serving.has_named_keys() and [r.name for r in serving.records()] == ["frank"]
    assert re.search(says, caplog.text) and "Keeping the keys read before" in caplog.text


def test_a_limit_too_large_to_count_is_refused_when_made(path):
    with pytest.raises(KeyStoreError, match="from 1 to 9,007,199,254,740,992"):
        KeyStore(path).add("big", tokens_per_day=10**400)


# --- keys required, for good ---------------------------------------------------------------


def test_once_named_keys_were_seen_a_deleted_or_emptied_file_still_requires_keys(path):
    clock = Clock()
    noted: list[bool] = []
    serving = KeyStore(path, clock=clock, on_keys_required=lambda: noted.append(True))
    assert not serving.requires_keys() and noted == []  # no keys yet: the port is open
    KeyStore(path).add("alice")
    clock.now += 1
    assert serving.requires_keys() and noted == [True]  # remembered in the settings (the service)
    path.write_text(json.dumps({"version": 1, "keys": []}))
    clock.now += 1
    assert serving.records() == [] and serving.requires_keys()
    path.unlink()
    clock.now += 1
    assert serving.requires_keys()
    # The next start knows it from the settings.
    assert KeyStore(path, keys_required=True).requires_keys()
    assert not KeyStore(path).requires_keys() and noted == [True]
