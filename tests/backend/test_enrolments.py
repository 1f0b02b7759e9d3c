"""Enrolment requests as the port keeps them: bounds, expiry, rates on a clock of the
test's own, and decisions written by another process (`gguf-studio keys ...`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.enrolments import (MAX_PER_ADDRESS, MAX_REQUESTS, PER_ADDRESS_BURST,
                                PER_ADDRESS_EVERY, EnrolmentFile, Enrolments)
from backend.errors import (EnrolmentNameTaken, EnrolmentRefused, EnrolmentsFull,
                            InvalidRequest, KeyStoreError, TooManyEnrolments)
from backend.key_store import KeyStore

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_request_past_its_ttl_is_forgotten_and_mints_nothing(enrolments, clock):
    enrolments.request("bob", "10.0.0.5")
    clock.now += 61

    assert enrolments.pending() == []
    with pytest.raises(KeyStoreError, match="No enrolment request named 'bob'"):
        enrolments.approve("bob")
    assert enrolments.keys.records() == []


def test_one_address_gets_a_burst_then_one_request_per_interval(enrolments, clock):
    for n in range(PER_ADDRESS_BURST):
        token = enrolments.request(f"n{n}", "10.0.0.5").token
        if n < PER_ADDRESS_BURST - 1:
            enrolments.refuse(f"n{n}")
            with pytest.raises(EnrolmentRefused):
                enrolments.collect(enrolments.find(token))
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
        clock.now += 7  # the port's own rate
        enrolments.request(f"b{n}", f"10.0.1.{n}")
    clock.now += 7
    with pytest.raises(EnrolmentsFull):
        enrolments.request("one-more", "10.0.2.1")
    assert len(enrolments.pending()) == MAX_REQUESTS


def test_names_are_checked_and_not_taken_twice(enrolments):
    enrolments.keys.add("alice")
    with pytest.raises(EnrolmentNameTaken):
        enrolments.request("ALICE", "10.0.0.5")
    enrolments.request("bob", "10.0.0.5")
    with pytest.raises(EnrolmentNameTaken):
        enrolments.request("Bob", "10.0.0.6")
    with pytest.raises(InvalidRequest):
        enrolments.request("owner", "10.0.0.7")
    with pytest.raises(InvalidRequest):
        enrolments.request("a b/../c", "10.0.0.7")


def test_the_file_shows_no_secret_and_takes_decisions_of_another_process(
        enrolments, tmp_path, monkeypatch):
    """`gguf-studio keys requests` and `keys approve` run in processes of their own: they
    read and write enrolments.json, and the port mints the key on its next sync."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    from backend.enrolments import enrolments_path
    from backend.key_store import keys_path

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
    EnrolmentFile(enrolments_path()).decide("bob", "approve", {"max_concurrent": 2})
    EnrolmentFile(enrolments_path()).decide("eve", "refuse")
    shared.sync()

    assert asked.state == "approved" and asked.secret.startswith("gs-")
    assert refused.state == "refused"
    minted = KeyStore(keys_path()).get("bob")
    assert minted is not None and minted.max_concurrent == 2
    assert KeyStore(keys_path()).get("eve") is None
    assert asked.secret not in enrolments_path().read_text()
    assert json.loads(keys("requests", "--json").stdout) == []
    unknown = keys("refuse", "nobody")
    assert unknown.returncode == 1 and "No enrolment request named 'nobody'" in unknown.stderr


def test_a_request_is_in_the_shared_file_before_its_code_is_told(enrolments, tmp_path):
    # The teammate reads its code to the owner, who lists the requests at once from
    # another process (`keys requests`): the file holds it without waiting for a sync.
    enrolment = enrolments.request("carol", "10.0.0.9")
    listed = EnrolmentFile(enrolments.file.path).requests()
    assert [(r.name, r.code) for r in listed] == [("carol", enrolment.code)]
