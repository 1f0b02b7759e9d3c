"""The keys as the window shows and edits them: the form read as `keys add|edit` reads
its options, rows with usage, the chart's bins, and a new key's client set-up."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from backend.app.sharing.key_table import (
    COLUMNS,
    KeyForm,
    describe_key,
    first_key_warning,
    key_table,
    key_target,
    parse_limit,
    parse_models,
    short_number,
    usage_chart,
)
from backend.app.service import StudioService
from backend.app.sharing.snippets import ClientModel, ClientTarget, opencode_snippet
from backend.keys.usage import MinuteUsage, UsageLedger
from backend.errors import KeyStoreError
from backend.keys.expiry import describe_recent, describe_time
from backend.keys.key_store import KeyRecord, KeyStore, Priority
from backend.settings import Settings

NOW = 1_750_000_000.0  # 10:26:40 UTC: 40 s into a minute
MINUTE = 60.0


def cell(row: tuple[str, ...], column: str) -> str:
    return row[COLUMNS.index(column)]


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore(tmp_path / "keys.json")


# --- the form --------------------------------------------------------------------------


def test_a_new_keys_form_reads_as_keys_add_reads_its_options():
    form = KeyForm(name=" alice ", models="qwen2.5-coder-7b, llama-3*,", max_concurrent=2,
                   tokens_per_minute=10_000, tokens_per_day=0, priority="interactive",
                   weight=2.0, expires="30d")
    limits = form.limits(now=NOW)
    assert limits == {"models": ("qwen2.5-coder-7b", "llama-3*"), "max_concurrent": 2,
                      "tokens_per_minute": 10_000, "tokens_per_day": None,
                      "priority": Priority.INTERACTIVE, "weight": 2.0,
                      "expires_at": NOW + 30 * 86400}
    assert KeyForm(name="bob", models="all").limits(now=NOW)["models"] == ()
    assert KeyForm(name="bob").limits(now=NOW)["expires_at"] is None


@pytest.mark.parametrize(("form", "words"), [
    (KeyForm(name="  "), "Give the key a name"),
    (KeyForm(name="a", max_concurrent=-1), "max concurrent -1 is not usable"),
    (KeyForm(name="a", weight=0.0), "weight must be a number above 0"),
    (KeyForm(name="a", weight=float("nan")), "weight must be a number above 0"),
    (KeyForm(name="a", priority="urgent"), "not one of interactive, normal, batch"),
    (KeyForm(name="a", expires="soon"), "is not a date"),
    (KeyForm(name="a", expires="2001-01-01"), "in the past"),
])
def test_an_unusable_setting_is_refused_in_words(form, words):
    with pytest.raises(KeyStoreError, match=words):
        form.limits(now=NOW)


def test_the_store_refuses_what_the_form_cannot_know(store):
    """A taken or malformed name: the store's check, worded for the dialog to show."""
    store.add("alice", **KeyForm(name="alice").limits())
    with pytest.raises(KeyStoreError, match="already exists"):
        store.add("Alice", **KeyForm(name="Alice").limits())
    with pytest.raises(KeyStoreError, match="not usable"):
        store.add("a b", **KeyForm(name="a b").limits())


def test_an_edit_changes_only_what_differs_and_keeps_an_expiry_left_as_shown(store):
    record, _ = store.add("alice", max_concurrent=2, tokens_per_minute=1000,
                          expires_at=time.time() + 3 * 86400)
    shown = KeyForm.of(record)
    assert shown.expires == describe_time(record.expires_at or 0)
    assert shown.changes(record) == {}
    edited = replace(shown, tokens_per_minute=5000, max_concurrent=0, models="tiny")
    assert edited.changes(record) == {"tokens_per_minute": 5000, "max_concurrent": None,
                                      "models": ("tiny",)}
    record = store.edit("alice", **edited.changes(record))
    assert (record.tokens_per_minute, record.max_concurrent, record.models) == (5000, None, ("tiny",))
    longer = replace(KeyForm.of(record), expires="never")
    assert longer.changes(record) == {"expires_at": None}


def test_a_weight_left_as_the_dialog_shows_it_is_not_a_change():
    record = KeyRecord("alice", weight=1 / 3)
    assert replace(KeyForm.of(record), weight=0.33).changes(record) == {}
    assert replace(KeyForm.of(record), weight=0.5).changes(record) == {"weight": 0.5}


def test_an_expired_key_can_be_edited_without_touching_its_expiry():
    expired = KeyRecord("old", expires_at=NOW - 60)
    form = replace(KeyForm.of(expired), weight=3.0)
    assert form.changes(expired, now=NOW) == {"weight": 3.0}


def test_limits_as_typed_on_the_command_line():
    assert parse_limit("1,000,000", "tokens per day") == 1_000_000
    assert parse_limit("1_000", "tokens per day") == 1000
    assert parse_limit("none", "x") is None and parse_limit("0", "x") is None
    with pytest.raises(KeyStoreError, match="give a whole number, or 0"):
        parse_limit("-3", "max concurrent")
    assert parse_models(" a ,b*, ") == ("a", "b*")
    assert parse_models("all") == () and parse_models("") == ()


def test_the_first_key_warns_that_clients_without_a_key_will_be_refused():
    assert "get 401" in first_key_warning(owner_key_set=False, named_keys=0)
    assert "owner's key" in first_key_warning(owner_key_set=True, named_keys=0)
    assert first_key_warning(owner_key_set=False, named_keys=1) == ""


# --- the table -------------------------------------------------------------------------


def test_rows_show_limits_state_and_usage(store, tmp_path: Path):
    alice, _ = store.add("alice", models=("tiny", "qwen*"), max_concurrent=2,
                         tokens_per_minute=10_000, priority=Priority.INTERACTIVE, weight=2.5)
    store.add("bob")
    store.revoke("bob")
    clock = [NOW]
    ledger = UsageLedger(tmp_path / "usage.json", clock=lambda: clock[0])
    ledger.record_wait("alice", 0.5)
    ledger.record_wait("alice", 1.5)
    ledger.record_request("alice", 1200, 34)
    ledger.record_refusal("alice", "tokens_per_minute")
    ledger.record_request("owner", 5, 5)

    table = key_table(store.records(), ledger.snapshot(), ledger.series(), owner_key_set=True,
                      chart_key=None, span=60, now=NOW)
    assert [r.name for r in table.rows] == ["owner", "alice", "bob"]
    assert table.named_keys == 2 and table.chart_keys == ("owner", "alice", "bob")
    owner, row, revoked = table.rows
    assert owner.owner and not owner.editable and not owner.revocable
    assert cell(owner.cells, "Requests") == "1" and "no limits" in owner.summary
    assert dict(zip(COLUMNS, row.cells)) == {
        "Name": "alice", "Models": "tiny, qwen*", "At once": "2", "Tokens/min": "10,000",
        "Tokens/day": "no limit", "Priority": "interactive", "Weight": "2.5",
        "Expires": "never", "State": "active", "Requests": "1", "Prompt tokens": "1,200",
        "Completion tokens": "34", "Mean queue wait": "1.00 s", "Refused": "1",
        "Last used": describe_recent(NOW, NOW)}
    assert row.refusals == {"tokens_per_minute": 1} and row.record == alice
    assert row.editable and row.revocable and row.summary == f"alice: {describe_key(alice)}."
    assert revoked.state == "revoked" and not revoked.editable and not revoked.revocable
    assert cell(revoked.cells, "Requests") == "0" and cell(revoked.cells, "Last used") == "never"
    assert cell(revoked.cells, "Mean queue wait") == "-"


def test_without_an_owner_key_only_named_keys_are_listed(store):
    store.add("alice")
    table = key_table(store.records(), {}, [], owner_key_set=False, chart_key="alice",
                      span=60, now=NOW)
    assert [r.name for r in table.rows] == ["alice"] and table.row("owner") is None


def test_an_expired_key_reads_expired():
    rows = key_table([KeyRecord("old", expires_at=NOW - 1)], {}, [], owner_key_set=False,
                     chart_key=None, span=60, now=NOW).rows
    assert rows[0].state == "expired" and rows[0].editable


# --- the chart -------------------------------------------------------------------------


def minute(start: float, requests: int = 1, prompt: int = 10, completion: int = 5,
           refusals: int = 0) -> MinuteUsage:
    return MinuteUsage(start, requests, prompt, completion, 0.0, 0, refusals)


def test_the_chart_sums_minutes_into_bars_ending_with_this_minute():
    this_minute = NOW - NOW % 60
    series = [minute(this_minute - 120 * MINUTE),  # outside the hour
              minute(this_minute - 59 * MINUTE, requests=2, prompt=100),
              minute(this_minute, refusals=3)]
    chart = usage_chart(series, "alice", 60, now=NOW)
    assert len(chart.bins) == 60 and chart.bin_seconds == 60
    assert chart.bins[0].start == this_minute - 59 * MINUTE
    assert (chart.bins[0].requests, chart.bins[0].prompt_tokens) == (2, 100)
    assert (chart.bins[-1].requests, chart.bins[-1].refusals) == (1, 3)
    assert sum(b.requests for b in chart.bins[1:-1]) == 0
    assert (chart.requests, chart.refusals, chart.total_tokens) == (3, 3, 120)
    assert chart.peak_tokens == 105 and chart.peak_requests == 4
    assert chart.summary == "3 requests with the key 'alice' (3 refused) in the last hour: 120 tokens."
    assert chart.ticks == ((0.0, "−60 min"), (0.5, "−30 min"), (1.0, "now"))


def test_a_days_chart_has_a_bar_per_24_minutes():
    this_minute = NOW - NOW % 60
    series = [minute(this_minute - m * MINUTE) for m in range(24 * 60)]
    chart = usage_chart(series, None, 24 * 60, now=NOW)
    assert len(chart.bins) == 60 and chart.bin_seconds == 24 * 60
    assert all(b.requests == 24 for b in chart.bins)
    assert chart.summary.startswith("1,440 requests in the last 24 hours")
    assert chart.ticks[0] == (0.0, "−24 h") and chart.ticks[1] == (0.5, "−12 h")


def test_an_idle_chart_says_so():
    assert usage_chart([], None, 60, now=NOW).summary == "No requests in the last hour."
    assert usage_chart([], "bob", 360, now=NOW).summary == \
        "No requests with the key 'bob' in the last 6 hours."


def test_scale_labels_are_short():
    assert [short_number(v) for v in (950, 1234, 12_345, 1_234_567, 12_345_678)] == \
        ["950", "1.2k", "12k", "1.2M", "12M"]


def test_the_services_chart_sums_the_minutes_over_once_and_this_minutes_every_time(tmp_path):
    """The minutes that are over are summed once a minute (a day of many keys is slow to
    sum); what happens in this minute shows at once; the next minute sums them again."""
    clock = [NOW]
    service = StudioService(Settings(), log_dir=tmp_path / "logs")
    service.usage = UsageLedger(tmp_path / "usage.json", clock=lambda: clock[0])
    service.usage.record_request("alice", 100, 10)
    clock[0] += MINUTE
    service.usage.record_request("alice", 200, 20)
    first = service.key_table("alice", 60, now=clock[0]).chart
    assert (first.requests, first.total_tokens) == (2, 330)
    sums: list[tuple[float | None, float | None]] = []
    service.usage.series = spy(service.usage.series, sums)  # type: ignore[method-assign]
    service.usage.record_request("alice", 300, 30)
    again = service.key_table("alice", 60, now=clock[0] + 1).chart
    assert (again.requests, again.total_tokens) == (3, 660)
    assert sums == [(NOW - NOW % 60 + MINUTE, None)]  # this minute's only
    clock[0] += MINUTE
    service.usage.record_request("alice", 1, 1)
    later = service.key_table("alice", 60, now=clock[0]).chart
    assert (later.requests, later.total_tokens) == (4, 662)
    assert len(sums) == 3  # the minutes over (now one more), then this one's
    assert service.key_table(None, 60, now=clock[0]).chart.requests == 4


def spy(series: Any, calls: list[tuple[float | None, float | None]]) -> Any:
    def called(key: str | None = None, since: float | None = None,
               until: float | None = None) -> list[MinuteUsage]:
        calls.append((since, until))
        return series(key, since, until)
    return called


# --- client set-up ---------------------------------------------------------------------

POOL = ClientTarget("http://192.168.1.20:8899/v1", "coder", "owner-key-0123456789",
                    context_length=32768, size=4_000_000_000,
                    others=(ClientModel("qwen-small", 8192, 400_000_000),
                            ClientModel("llama-big", 8192, 9_000_000_000)))


def test_a_new_key_is_set_up_with_its_secret_and_only_the_models_it_may_use():
    target = key_target(POOL, KeyRecord("alice", models=("qwen*", "llama-big")), "gs-secret")
    assert target.api_key == "gs-secret"
    assert [m.model_id for m in target.models] == ["qwen-small", "llama-big"]
    assert target.context_length == 8192
    snippet = opencode_snippet(target)
    assert "coder" not in snippet.text and "gs-secret" in snippet.shell
    assert "owner-key" not in snippet.text + snippet.shell
    every = key_target(POOL, KeyRecord("bob"), "gs-bob")
    assert [m.model_id for m in every.models] == ["coder", "qwen-small", "llama-big"]


def test_a_key_for_models_not_served_yet_names_the_first_it_lists():
    assert key_target(POOL, KeyRecord("c", models=("mistral", "x*")), "s").model_id == "mistral"
    assert key_target(POOL, KeyRecord("c", models=("x*",)), "s").model_id == "coder"
