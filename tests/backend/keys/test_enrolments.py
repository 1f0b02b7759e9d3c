"""Enrolment requests as the port keeps them: bounds, expiry, rates on a clock of the
test's own, and decisions written by another process (`gguf-studio keys ...`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.keys.enrolments import (MAX_PER_ADDRESS, MAX_REQUESTS, NAME_TAKEN, PER_ADDRESS_BURST,
                                PER_ADDRESS_EVERY, PORT_EVERY, Enrolment, EnrolmentFile,
                                Enrolments)
from backend.errors import (EnrolmentNameTaken, EnrolmentNotFound, EnrolmentRefused,
                            EnrolmentsFull, InvalidRequest, KeyStoreError, TooManyEnrolments)
from backend.keys.key_store import KeyStore

ROOT = Path(__file__).resolve().parents[3]


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def enrolments(clock: Clock, tmp_path: Path) -> Enrolments:
    return Enrolments(KeyStore(tmp_path / "keys.json"), path=tmp_path / "enrolments.json",
                      ttl=lambda: 60.0, clock=clock)


def seen(enrolment: Enrolment) -> tuple[str, str, float]:
    """What the owner checked of a request: its name, code and time asked."""
    return enrolment.name, enrolment.code, enrolment.requested_at


def test_a_request_past_its_ttl_is_forgotten_and_mints_nothing(enrolments, clock):
    asked = enrolments.request("bob", "10.0.0.5")
    clock.now += 61

    assert enrolments.pending() == []
    with pytest.raises(KeyStoreError, match="No request named 'bob' with code"):
        enrolments.approve(*seen(asked))
    assert enrolments.keys.records() == []


def test_the_key_is_made_when_collected_with_the_approved_limits_and_handed_over_once(
        enrolments, clock):
    asked = enrolments.request("bob", "10.0.0.5")
    enrolments.approve(*seen(asked), tokens_per_minute=500)
    assert enrolments.keys.records() == []  # approved: nothing made yet

    record, secret = enrolments.collect(enrolments.find(asked.token))

    assert (record.name, record.tokens_per_minute) == ("bob", 500)
    assert enrolments.keys.authenticate(secret) == record
    with pytest.raises(EnrolmentNotFound):
        enrolments.find(asked.token)
    with pytest.raises(EnrolmentNotFound):  # a second poll that woke with the first
        enrolments.collect(asked)
    assert len(enrolments.keys.records()) == 1


def test_an_approval_not_collected_before_the_request_expires_makes_no_key(enrolments, clock):
    """Decided but uncollected requests expire like pending ones: the key is never made,
    and the place is free again."""
    asked = enrolments.request("bob", "10.0.0.5")
    enrolments.approve(*seen(asked), tokens_per_minute=500)
    clock.now += 59
    assert enrolments.find(asked.token).state == "approved"  # still collectable
    clock.now += 2

    with pytest.raises(EnrolmentNotFound):
        enrolments.find(asked.token)
    with pytest.raises(EnrolmentNotFound):
        enrolments.collect(asked)
    assert enrolments.keys.records() == []
    for n in range(MAX_REQUESTS):  # every place free: that one holds none
        clock.now += PORT_EVERY
        enrolments.request(f"n{n}", f"10.0.1.{n}")


def test_approving_checks_the_limits_now_and_leaves_a_bad_one_pending(enrolments):
    asked = enrolments.request("bob", "10.0.0.5")
    with pytest.raises(KeyStoreError, match="weight must be a number above 0"):
        enrolments.approve(*seen(asked), weight=0)
    enrolments.keys.add("BOB")  # the owner made a key of that name meanwhile
    with pytest.raises(KeyStoreError, match="already exists"):
        enrolments.approve(*seen(asked))
    assert [e.state for e in enrolments.pending()] == ["pending"]


def test_a_request_replaced_by_another_of_the_same_name_is_never_the_one_approved(
        enrolments, clock):
    """The name race: a stranger retries the teammate's name until the teammate's
    request expires, then takes the name with another code.  The owner approves what it
    checked (the teammate's code): nothing is approved for the stranger."""
    teammate = enrolments.request("carol", "10.0.0.5")
    checked = seen(teammate)
    clock.now += 61
    stranger = enrolments.request("carol", "10.0.0.66")
    assert stranger.code != teammate.code or stranger.requested_at != teammate.requested_at

    with pytest.raises(KeyStoreError, match="not the one with code"):
        enrolments.approve(*checked)
    with pytest.raises(KeyStoreError, match="not the one with code"):
        enrolments.refuse(*checked)
    with pytest.raises(KeyStoreError, match="not the one with code"):  # its time, too
        enrolments.approve("carol", stranger.code, teammate.requested_at)
    assert enrolments.find(stranger.token).state == "pending"
    assert enrolments.keys.records() == []


def test_every_attempt_takes_a_token_invalid_and_taken_names_too(enrolments, clock):
    enrolments.keys.add("alice")
    enrolments.request("bob", "10.0.0.5")
    tries = ["alice", "BOB", "owner"]  # a key, a waiting request, a name no key may have
    assert len(tries) == PER_ADDRESS_BURST
    for name in tries:
        with pytest.raises((EnrolmentNameTaken, InvalidRequest)):
            enrolments.request(name, "10.0.0.66")
    with pytest.raises(TooManyEnrolments) as refused:
        enrolments.request("carol", "10.0.0.66")
    assert refused.value.retry_after == pytest.approx(PER_ADDRESS_EVERY)


def test_a_taken_name_gets_one_answer_whether_a_key_or_a_request_has_it(enrolments):
    enrolments.keys.add("alice")
    enrolments.request("bob", "10.0.0.5")
    with pytest.raises(EnrolmentNameTaken) as key:
        enrolments.request("ALICE", "10.0.0.6")
    with pytest.raises(EnrolmentNameTaken) as waiting:
        enrolments.request("Bob", "10.0.0.7")
    assert str(key.value) == str(waiting.value) == NAME_TAKEN
    assert "alice" not in NAME_TAKEN.casefold() and "request" not in NAME_TAKEN.casefold()
    with pytest.raises(InvalidRequest):
        enrolments.request("a b/../c", "10.0.0.8")


def test_one_address_gets_a_burst_then_one_request_per_interval(enrolments, clock):
    for n in range(PER_ADDRESS_BURST):
        asked = enrolments.request(f"n{n}", "10.0.0.5")
        if n < PER_ADDRESS_BURST - 1:
            enrolments.refuse(*seen(asked))
    with pytest.raises(TooManyEnrolments) as refused:
        enrolments.request("again", "10.0.0.5")
    assert refused.value.retry_after == pytest.approx(PER_ADDRESS_EVERY)
    clock.now += PER_ADDRESS_EVERY
    enrolments.request("later", "10.0.0.5")  # its one new token


def test_an_address_holds_few_waiting_requests_and_the_port_few_in_all(enrolments, clock):
    for n in range(MAX_PER_ADDRESS):
        enrolments.request(f"a{n}", "10.0.0.5")
    with pytest.raises(TooManyEnrolments):
        enrolments.request("a-more", "10.0.0.5")
    for n in range(MAX_REQUESTS - MAX_PER_ADDRESS):
        clock.now += PORT_EVERY  # the port's own rate
        enrolments.request(f"b{n}", f"10.0.1.{n}")
    clock.now += PORT_EVERY
    with pytest.raises(EnrolmentsFull):
        enrolments.request("one-more", "10.0.2.1")
    assert len(enrolments.pending()) == MAX_REQUESTS


def test_a_refused_request_frees_its_place_at_once_and_its_requester_learns_it_once(
        enrolments, clock):
    asked = [enrolments.request(f"a{n}", f"10.0.0.{n // MAX_PER_ADDRESS}")
             for n in range(MAX_PER_ADDRESS * 2)]
    for n in range(MAX_REQUESTS - len(asked)):
        clock.now += PORT_EVERY
        enrolments.request(f"b{n}", f"10.0.1.{n}")
    for enrolment in asked:  # never polled by their requesters
        enrolments.refuse(*seen(enrolment))
    clock.now += PORT_EVERY

    enrolments.request("teammate", "10.0.2.1")  # a place, and its address may ask again
    enrolments.request("a0", "10.0.0.0")
    with pytest.raises(EnrolmentRefused):
        enrolments.find(asked[1].token)
    with pytest.raises(EnrolmentNotFound):  # told once
        enrolments.find(asked[1].token)


def test_refusals_not_yet_told_are_few_and_forgotten_at_the_requests_expiry(
        enrolments, clock, monkeypatch):
    monkeypatch.setattr("backend.keys.enrolments.MAX_REFUSED", 2)
    asked = []
    for n in range(3):
        clock.now += PORT_EVERY
        asked.append(enrolments.request(f"n{n}", f"10.0.0.{n}"))
        enrolments.refuse(*seen(asked[-1]))
    with pytest.raises(EnrolmentNotFound):  # the oldest refusal, forgotten
        enrolments.find(asked[0].token)
    clock.now += 61
    with pytest.raises(EnrolmentNotFound):
        enrolments.find(asked[2].token)


@pytest.mark.parametrize("decision, error", [
    (42, "not readable"),
    (["bob"], "not readable"),
    ({"action": "approve", "name": "bob", "limits": {}}, "does not name a request"),
    ({"action": "approve", "name": "bob", "code": "XYZ-234", "requested_at": "today"},
     "does not name a request"),
    ({"action": "aprove", "limits": {}}, "neither 'approve' nor 'refuse'"),
    ({"action": "Refuse"}, "neither 'approve' nor 'refuse'"),
    ({"action": None}, "neither 'approve' nor 'refuse'"),
    ({}, "neither 'approve' nor 'refuse'"),
    ({"action": "approve", "limits": {"admin": True}}, "limits are not readable"),
    ({"action": "approve", "limits": {"models": "qwen"}}, "models are not a list"),
    ({"action": "approve", "limits": "all"}, "limits are not readable"),
])
def test_a_decision_that_is_not_an_explicit_approval_approves_nothing(
        enrolments, decision, error):
    """Only "approve" of the request named by its name, code and time approves: a
    decision another process wrote wrong fails, and the port keeps taking decisions."""
    asked = enrolments.request("bob", "10.0.0.5")
    if isinstance(decision, dict) and "name" not in decision:
        decision = dict(decision, name="bob", code=asked.code, requested_at=asked.requested_at)
    write_decisions(enrolments.file.path, [decision])

    enrolments.sync()

    (outcome,) = enrolments.file.outcomes()
    assert outcome["result"] == "failed" and error in outcome["error"], outcome
    assert enrolments.find(asked.token).state == "pending"
    write_decisions(enrolments.file.path, [
        {"name": "bob", "code": asked.code, "requested_at": asked.requested_at,
         "action": "refuse", "limits": {}}])
    enrolments.sync()
    with pytest.raises(EnrolmentRefused):
        enrolments.find(asked.token)
    assert enrolments.keys.records() == []


def test_a_file_that_does_not_hold_enrolments_is_written_anew(enrolments):
    asked = enrolments.request("bob", "10.0.0.5")
    enrolments.file.path.write_text('{"version": 1, "decisions": 7}')

    enrolments.sync()

    assert [r.code for r in enrolments.file.requests()] == [asked.code]
    assert enrolments.file.outcomes()[0]["result"] == "failed"
    enrolments.file.decide(asked.code, "approve")
    enrolments.sync()
    assert enrolments.find(asked.token).state == "approved"


def test_the_file_shows_no_secret_and_takes_decisions_of_another_process(
        enrolments, tmp_path, monkeypatch):
    """`gguf-studio keys requests` and `keys approve` run in processes of their own: they
    read and write enrolments.json; the port takes the decision on its next sync, and
    makes the key when its requester collects it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    from backend.keys.enrolments import enrolments_path
    from backend.keys.key_store import keys_path

    shared = Enrolments(KeyStore(keys_path()), path=enrolments_path())
    asked = shared.request("bob", "10.0.0.5")
    refused = shared.request("eve", "10.0.0.6")
    shared.sync()
    text = enrolments_path().read_text()
    assert asked.token not in text and asked.code in text

    def keys(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "backend.app.cli", "keys", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)

    listing = json.loads(keys("requests", "--json").stdout)
    assert [(r["name"], r["address"], r["code"]) for r in listing] == [
        ("bob", "10.0.0.5", asked.code), ("eve", "10.0.0.6", refused.code)]
    EnrolmentFile(enrolments_path()).decide(asked.code, "approve", {"max_concurrent": 2})
    EnrolmentFile(enrolments_path()).decide(refused.code, "refuse", name="EVE")
    decisions = json.loads(enrolments_path().read_text())["decisions"]
    assert [(d["name"], d["code"], d["requested_at"], d["action"]) for d in decisions] == [
        ("bob", asked.code, asked.requested_at, "approve"),
        ("eve", refused.code, refused.requested_at, "refuse")]
    shared.sync()

    assert shared.find(asked.token).state == "approved"
    with pytest.raises(EnrolmentRefused):
        shared.find(refused.token)
    record, secret = shared.collect(shared.find(asked.token))
    minted = KeyStore(keys_path()).get("bob")
    assert minted is not None and minted.max_concurrent == 2 and minted == record
    assert KeyStore(keys_path()).get("eve") is None
    assert secret not in enrolments_path().read_text()
    assert json.loads(keys("requests", "--json").stdout) == []
    assert [o["result"] for o in EnrolmentFile(enrolments_path()).outcomes()] == [
        "approved", "refused", "collected"]
    unknown = keys("refuse", "ABC-DEF")
    assert unknown.returncode == 1 and "No request with code ABC-DEF" in unknown.stderr


def test_a_decision_by_name_needs_the_code_of_that_name(enrolments):
    asked = enrolments.request("carol", "10.0.0.5")
    other = enrolments.request("dave", "10.0.0.6")
    with pytest.raises(KeyStoreError, match="No request named 'carol' with code"):
        enrolments.file.decide(other.code, "approve", name="carol")
    enrolments.file.decide(asked.code, "approve", name="Carol")


def test_a_request_is_in_the_shared_file_before_its_code_is_told(enrolments, tmp_path):
    # The teammate reads its code to the owner, who lists the requests at once from
    # another process (`keys requests`): the file holds it without waiting for a sync.
    enrolment = enrolments.request("carol", "10.0.0.9")
    listed = EnrolmentFile(enrolments.file.path).requests()
    assert [(r.name, r.code) for r in listed] == [("carol", enrolment.code)]


def write_decisions(path: Path, decisions: list[object]) -> None:
    saved = json.loads(path.read_text())
    saved["decisions"] = decisions
    path.write_text(json.dumps(saved))
