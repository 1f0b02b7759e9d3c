"""`gguf-studio keys ...` as a user runs it: real processes, the real files."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backend.keys.usage import UsageLedger
from backend.errors import KeyRevoked
from backend.keys.key_store import KeyStore, Priority, hash_secret
from tests.backend.gateway_harness import until
from tests.not_none import not_none

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A user with no saved settings and no key in the environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    return dict(base, XDG_CONFIG_HOME=str(tmp_path / "config"),
                XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return tmp_path / "config" / "gguf-studio"


def keys(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.app.cli", "keys", *args], cwd=ROOT,
                          text=True, capture_output=True, env=env, timeout=60)


def test_add_prints_the_secret_alone_once_and_stores_only_its_hash(env, config, loose_umask):
    made = keys(env, "add", "alice", "--models", "qwen2.5-coder-7b,llama-3*",
                "--max-concurrent", "2", "--tokens-per-minute", "10000",
                "--tokens-per-day", "1,000,000", "--priority", "interactive",
                "--weight", "2", "--expires", "30d")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert made.stdout == secret + "\n" and secret.startswith("gs-")
    assert "only time its secret is shown" in made.stderr and secret not in made.stderr
    assert "10,000 tokens per minute" in made.stderr
    stored = (config / "keys.json").read_text()
    assert secret not in stored and secret[3:] not in stored
    assert hash_secret(secret) in stored
    record = not_none(KeyStore(config / "keys.json").authenticate(secret))
    assert record.name == "alice"
    assert record.models == ("qwen2.5-coder-7b", "llama-3*")
    assert (record.max_concurrent, record.tokens_per_minute, record.tokens_per_day) == \
        (2, 10_000, 1_000_000)
    assert (record.priority, record.weight) == (Priority.INTERACTIVE, 2.0)
    assert 29 * 86400 < not_none(record.expires_at) - time.time() <= 30 * 86400
    if os.name != "nt":
        assert (config / "keys.json").stat().st_mode & 0o777 == 0o600
        assert config.stat().st_mode & 0o777 == 0o700


def test_list_shows_limits_usage_and_last_use_and_never_a_secret(env, config):
    secret = keys(env, "add", "alice", "--tokens-per-minute", "5000").stdout.strip()
    keys(env, "add", "batch-bot", "--priority", "batch", "--weight", "0.5")
    ledger = UsageLedger(config / "usage.json")
    ledger.record_wait("alice", 0.25)
    ledger.record_request("alice", 1200, 300)
    ledger.record_refusal("alice", "tokens_per_minute")
    ledger.save()

    listed = keys(env, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    entries = {e["name"]: e for e in json.loads(listed.stdout)}
    assert set(entries) == {"alice", "batch-bot"}
    alice = entries["alice"]
    assert (alice["status"], alice["tokens_per_minute"], alice["models"]) == ("active", 5000, [])
    assert alice["usage"]["requests"] == 1
    assert (alice["usage"]["prompt_tokens"], alice["usage"]["completion_tokens"]) == (1200, 300)
    assert alice["usage"]["mean_wait"] == 0.25
    assert alice["usage"]["refusals"] == {"tokens_per_minute": 1}
    assert alice["usage"]["last_used"] is not None
    assert entries["batch-bot"]["usage"]["requests"] == 0
    assert (entries["batch-bot"]["priority"], entries["batch-bot"]["weight"]) == ("batch", 0.5)

    table = keys(env, "list")
    assert table.returncode == 0
    header, *rows = table.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "STATUS", "MODELS"]
    assert rows[0].split()[:5] == ["alice", "active", "all", "-", "5,000"]
    assert "1,500" in rows[0] and "0.25s" in rows[0] and "never" not in rows[0].split()[-2:]
    assert rows[1].split()[:2] == ["batch-bot", "active"] and rows[1].endswith("never")
    for out in (listed.stdout, table.stdout):
        assert secret not in out and hash_secret(secret) not in out


def test_the_owners_key_is_listed_without_limits_and_without_its_secret(env):
    owner = dict(env, GGUF_STUDIO_API_KEY="gs-owners-secret-for-this-test")
    entries = json.loads(keys(owner, "list", "--json").stdout)
    assert [(e["name"], e["owner"], e["models"], e["tokens_per_minute"]) for e in entries] == \
        [("owner", True, [], None)]
    table = keys(owner, "list").stdout
    assert "owner" in table and "gs-owners-secret-for-this-test" not in table
    assert json.loads(keys(env, "list", "--json").stdout) == []


def test_edit_changes_only_what_is_given(env, config):
    keys(env, "add", "bob", "--tokens-per-minute", "1000", "--models", "qwen")
    edited = keys(env, "edit", "bob", "--tokens-per-day", "50000", "--weight", "3")
    assert edited.returncode == 0, edited.stderr
    assert "50,000 tokens per day" in edited.stdout and "1,000 tokens per minute" in edited.stdout
    record = not_none(KeyStore(config / "keys.json").get("bob"))
    assert (record.tokens_per_minute, record.tokens_per_day, record.weight, record.models) == \
        (1000, 50_000, 3.0, ("qwen",))
    cleared = keys(env, "edit", "bob", "--tokens-per-minute", "none", "--models", "all",
                   "--expires", "2099-01-01")
    assert cleared.returncode == 0, cleared.stderr
    record = not_none(KeyStore(config / "keys.json").get("bob"))
    assert (record.tokens_per_minute, record.models) == (None, ())
    assert record.expires_at is not None


def test_revoke_reaches_a_running_port_and_the_key_stays_listed(env, config):
    secret = keys(env, "add", "leaked").stdout.strip()
    serving = KeyStore(config / "keys.json", check_interval=0)  # a port already running
    assert not_none(serving.authenticate(secret)).name == "leaked"
    revoked = keys(env, "revoke", "leaked")
    assert revoked.returncode == 0 and "401 from now on" in revoked.stdout
    with pytest.raises(KeyRevoked):
        serving.authenticate(secret)
    again = keys(env, "revoke", "leaked")
    assert again.returncode == 0 and "already revoked" in again.stdout
    assert json.loads(keys(env, "list", "--json").stdout)[0]["status"] == "revoked"


@pytest.mark.parametrize("args, message", [
    (("add", "dup"), "A key named 'dup' already exists; choose another name"),
    (("add", "DUP"), "A key named 'dup' already exists; choose another name"),
    (("add", "x", "--expires", "next week"), "The expiry 'next week' is not a date"),
    (("add", "x", "--expires", "2001-01-01"), "is in the past"),
    (("add", "x", "--weight", "0"), "weight must be a number above 0"),
    (("add", "x", "--weight", "-2"), "weight must be a number above 0"),
    (("add", "x", "--weight", "heavy"), "The weight 'heavy' is not a number"),
    (("add", "x", "--tokens-per-minute", "-5"), "tokens per minute '-5' is not usable"),
    (("add", "x", "--max-concurrent", "two"), "max concurrent 'two' is not usable"),
    (("add", "owner"), "name of the owner's key"),
    (("add", "two words"), "is not usable"),
    (("edit", "dup"), "Nothing to change"),
    (("edit", "ghost", "--weight", "2"), "There is no key named 'ghost'"),
    (("revoke", "ghost"), "There is no key named 'ghost'"),
])
def test_bad_input_is_one_clear_line_and_changes_nothing(env, config, args, message):
    keys(env, "add", "dup")
    before = (config / "keys.json").read_bytes()
    out = keys(env, *args)
    assert out.returncode == 1
    assert message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stdout == ""
    assert (config / "keys.json").read_bytes() == before


def test_an_unknown_priority_is_refused_by_the_parser(env):
    out = keys(env, "add", "x", "--priority", "urgent")
    assert out.returncode == 2
    assert "invalid choice: 'urgent'" in out.stderr


# --- answering a teammate's request (gguf-studio connect) on a running port --------------


OWNER_KEY = "owner-key-for-the-keys-cli-tests-0123456"


@pytest.fixture
async def port(running_service, env, monkeypatch):
    """A running port sharing the command's config dir (keys, enrolments.json)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", env["XDG_CONFIG_HOME"])
    service = await running_service(api_key=OWNER_KEY, host="127.0.0.1",
                                    accept_enrolments_until=time.time() + 600)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=60) as http:
        yield service, http


async def keys_beside(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`keys ...` while the port runs on this test's loop (which takes its decision)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "keys", *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return subprocess.CompletedProcess(args, not_none(proc.returncode), out.decode(), err.decode())


async def test_keys_refuse_by_code_refuses_the_waiting_teammate_and_makes_no_key(env, port):
    service, http = port
    asked = (await http.post("/v1/enrolments", json={"name": "bob"})).json()
    answer = asyncio.ensure_future(http.get(asked["poll"], params={"wait": 30}))
    listed = await keys_beside(env, "requests")
    assert "bob" in listed.stdout and asked["code"] in listed.stdout
    assert "keys approve CODE" in listed.stderr

    refused = await keys_beside(env, "refuse", asked["code"].lower().replace("-", " "))

    assert refused.returncode == 0, refused.stderr
    assert f"Request 'bob' from 127.0.0.1 (code {asked['code']}) refused" in refused.stdout
    assert (await answer).status_code == 403, (await answer).text
    assert (await answer).json()["error"]["code"] == "enrolment_refused"
    assert KeyStore().records() == []
    assert service.enrolments.waiting() == []
    assert (await http.get(asked["poll"])).status_code == 404


async def test_keys_approve_by_code_gives_the_waiting_teammate_a_key_with_its_limits(env, port):
    service, http = port
    asked = (await http.post("/v1/enrolments", json={"name": "bob"})).json()
    answer = asyncio.ensure_future(http.get(asked["poll"], params={"wait": 30}))

    approved = await keys_beside(env, "approve", "BOB", "--code", asked["code"],
                                 "--tokens-per-minute", "700")

    assert approved.returncode == 0, approved.stderr
    assert f"Key 'bob' made and sent to 127.0.0.1 (code {asked['code']})" in approved.stdout
    got = await answer
    assert got.status_code == 200 and got.json()["name"] == "bob", got.text
    models = await http.get("/v1/models",
                            headers={"Authorization": f"Bearer {got.json()['api_key']}"})
    assert models.status_code == 200
    assert not_none(KeyStore().get("bob")).tokens_per_minute == 700


@pytest.mark.parametrize("args, message", [
    (("approve", "bob"), "'bob' is not a request's code"),
    (("approve", "bob", "--code", "XYZ-234"), "No request named 'bob' with code XYZ-234"),
    (("approve", "carol", "--code", "{code}"), "No request named 'carol' with code {code}"),
    (("refuse", "XYZ-234"), "No request with code XYZ-234 is waiting"),
])
async def test_a_decision_names_the_request_by_its_code(env, port, args, message):
    service, http = port
    asked = (await http.post("/v1/enrolments", json={"name": "bob"})).json()

    out = await keys_beside(env, *(a.format(code=asked["code"]) for a in args))

    assert out.returncode == 1 and message.format(code=asked["code"]) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert [r.name for r in service.enrolments.waiting()] == ["bob"]


async def test_a_bad_decision_in_the_file_ends_no_watch_and_the_next_one_is_taken(env, port):
    """A non-object, or an action that is not "approve", written into enrolments.json by
    hand or by a broken tool: it fails alone, approves nothing, and `keys refuse` still
    reaches the port (before, one such entry ended the port's key watcher for good)."""
    from backend.keys.enrolments import enrolments_path

    service, http = port
    asked = (await http.post("/v1/enrolments", json={"name": "bob"})).json()
    (request,) = service.enrolments.waiting()
    saved = json.loads(enrolments_path().read_text())
    saved["decisions"] = [42, {"name": "bob", "code": request.code, "action": "aprove",
                               "requested_at": request.requested_at, "limits": {}}]
    enrolments_path().write_text(json.dumps(saved))
    await until(lambda: len(json.loads(enrolments_path().read_text())["outcomes"]) == 2, 30)
    outcomes = json.loads(enrolments_path().read_text())["outcomes"]
    assert [o["result"] for o in outcomes] == ["failed", "failed"]
    assert [r.name for r in service.enrolments.waiting()] == ["bob"]

    refused = await keys_beside(env, "refuse", asked["code"])

    assert refused.returncode == 0, refused.stderr
    assert (await http.get(asked["poll"])).status_code == 403
    assert KeyStore().records() == []


async def test_a_failing_check_is_logged_once_and_the_watch_goes_on(env, port, caplog,
                                                                     monkeypatch):
    """Whatever one check of the key watcher raises (here a fault injected into the
    enrolment sync), the next checks still run: revoked keys and decisions are still
    taken."""
    service, http = port
    real_sync = service.enrolments.sync
    calls = {"n": 0}

    def sync_failing_three_times() -> None:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise RuntimeError("an injected fault")
        real_sync()

    monkeypatch.setattr(service.enrolments, "sync", sync_failing_three_times)
    asked = (await http.post("/v1/enrolments", json={"name": "bob"})).json()

    refused = await keys_beside(env, "refuse", asked["code"])

    assert refused.returncode == 0, refused.stderr
    assert calls["n"] > 3
    logged = [r for r in caplog.records if r.exc_info and "injected" in str(r.exc_info[1])]
    assert len(logged) == 1, caplog.text  # once, not at every try
