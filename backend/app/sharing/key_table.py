"""Named keys as people see and change them: the form of `keys add|edit` (in the window's
dialog and on the command line), the table of keys with their usage, the usage chart's
bins, and the client set-up a new key's holder pastes.

The form reads and checks what a person gave as `gguf-studio keys add` reads its options
(0 or none: no limit; models comma-separated, "all" for every one; an expiry as
`parse_expiry` takes it); the key store then checks the rest (the name, a duplicate).
The table and the chart are built on the backend's loop, where the key store and the
usage ledger live, and handed to the window as plain values.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backend.app.sharing.snippets import ClientModel, ClientTarget
from backend.keys.usage import KeyUsage, MinuteUsage
from backend.errors import KeyStoreError
from backend.keys.expiry import describe_recent, describe_time, parse_expiry
from backend.keys.key_store import CHAT_NAME, OWNER, OWNER_CHAT, KeyRecord, Priority

__all__ = [
    "CHART_BINS",
    "CHART_SPANS",
    "COLUMNS",
    "WEIGHT_STEP",
    "KeyForm",
    "KeyRow",
    "KeyTable",
    "UsageBin",
    "UsageChart",
    "client_setup",
    "describe_key",
    "describe_limit",
    "first_key_warning",
    "key_row",
    "key_table",
    "key_target",
    "parse_limit",
    "parse_models",
    "short_number",
    "usage_chart",
]

#: The table's columns, in order (`KeyRow.cells`).
COLUMNS = ("Name", "Models", "At once", "Tokens/min", "Tokens/day", "Priority", "Weight",
           "Expires", "State", "Requests", "Prompt tokens", "Completion tokens",
           "Mean queue wait", "Refused", "Last used")
#: The chart's spans in minutes, with their names; a day is what the ledger keeps.
CHART_SPANS = ((60, "Last hour"), (6 * 60, "Last 6 hours"), (24 * 60, "Last 24 hours"))
#: The smallest change of a key's weight a form tells apart.
WEIGHT_STEP = 0.01
#: Bars per chart, whatever its span: a minute each over an hour, 24 minutes over a day.
CHART_BINS = 60


# --- the form --------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyForm:
    """A key's settings as a person gives them (the dialog's fields, the command line's
    options): 0 for no limit, models comma-separated ("" or "all": every model), the
    expiry as text ("never", "30d", "2026-03-31")."""

    name: str = ""
    models: str = ""
    max_concurrent: int = 0
    tokens_per_minute: int = 0
    tokens_per_day: int = 0
    priority: str = Priority.NORMAL.value
    weight: float = 1.0
    expires: str = "never"

    @classmethod
    def of(cls, record: KeyRecord) -> "KeyForm":
        """The form that shows `record` as it is (to edit it)."""
        return cls(name=record.name, models=", ".join(record.models),
                   max_concurrent=record.max_concurrent or 0,
                   tokens_per_minute=record.tokens_per_minute or 0,
                   tokens_per_day=record.tokens_per_day or 0,
                   priority=record.priority.value, weight=record.weight,
                   expires=describe_time(record.expires_at) if record.expires_at else "never")

    def limits(self, now: float | None = None) -> dict[str, Any]:
        """Every setting as `KeyStore.add` takes it; raises KeyStoreError, worded for the
        person, for one that is not usable."""
        if not self.name.strip():
            raise KeyStoreError("Give the key a name: who or what will use it "
                                "(alice, ci-bot, laptop@home).")
        return {"models": parse_models(self.models),
                "max_concurrent": _whole_limit(self.max_concurrent, "max concurrent"),
                "tokens_per_minute": _whole_limit(self.tokens_per_minute, "tokens per minute"),
                "tokens_per_day": _whole_limit(self.tokens_per_day, "tokens per day"),
                "priority": _priority(self.priority),
                "weight": _weight(self.weight),
                "expires_at": parse_expiry(self.expires, now)}

    def changes(self, record: KeyRecord, now: float | None = None) -> dict[str, Any]:
        """What differs from `record`, as `KeyStore.edit` takes it: an expiry left as
        shown stays as it is (also one already past), the rest is checked as by
        `limits`."""
        shown = KeyForm.of(record)
        changes: dict[str, Any] = {}
        if parse_models(self.models) != record.models:
            changes["models"] = parse_models(self.models)
        for name, what in (("max_concurrent", "max concurrent"),
                           ("tokens_per_minute", "tokens per minute"),
                           ("tokens_per_day", "tokens per day")):
            value = _whole_limit(getattr(self, name), what)
            if value != getattr(record, name):
                changes[name] = value
        if _priority(self.priority) != record.priority:
            changes["priority"] = _priority(self.priority)
        # The dialog shows a weight to two decimals: one left as shown stays as it is.
        if abs(_weight(self.weight) - record.weight) >= WEIGHT_STEP / 2:
            changes["weight"] = _weight(self.weight)
        if self.expires.strip() != shown.expires:
            changes["expires_at"] = parse_expiry(self.expires, now)
        return changes


def parse_limit(text: str, what: str) -> int | None:
    """A limit as typed: a whole number ("1,000,000" and "1_000" too), 0 or "none" for
    no limit."""
    if text.strip().lower() in {"none", "0"}:
        return None
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = -1
    if value < 1:
        raise KeyStoreError(f"The {what} {text!r} is not usable: give a whole number, or 0 "
                            "(or none) for no limit.")
    return value


def parse_models(text: str) -> tuple[str, ...]:
    """Model names (or patterns such as "qwen*") separated by commas; none or "all": every
    model."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    return () if names in {(), ("all",)} else names


def describe_key(record: KeyRecord) -> str:
    """A key's limits in one sentence ("all models; at most 2 at once; ...")."""
    parts = ["models " + ", ".join(record.models) if record.models else "all models",
             f"at most {record.max_concurrent} at once" if record.max_concurrent
             else "no limit at once",
             f"{record.tokens_per_minute:,} tokens per minute" if record.tokens_per_minute
             else "no limit per minute",
             f"{record.tokens_per_day:,} tokens per day" if record.tokens_per_day
             else "no limit per day",
             f"{record.priority} priority, weight {record.weight:g}",
             f"expires {describe_time(record.expires_at)}" if record.expires_at
             else "never expires"]
    return "; ".join(parts)


def first_key_warning(*, owner_key_set: bool, named_keys: int) -> str:
    """What making the first named key changes for clients that send no key, "" once
    keys exist (the gateway asks every request for a key as soon as one does)."""
    if named_keys:
        return ""
    if owner_key_set:
        return ("From now on this key and the owner's key in Access are the only ways in: "
                "each key is its own share of the model.")
    return ("Once a key exists, every client must send one, also on this computer: "
            "clients that send none now will get 401 until they send a key.")


# --- the table -------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyRow:
    """One key as the table shows it."""

    name: str
    state: str  # "active", "revoked", "expired"
    cells: tuple[str, ...]  # by COLUMNS
    summary: str  # the key's limits in a sentence (the row's tooltip)
    refusals: Mapping[str, int]  # by reason, for the Refused cell's tooltip
    record: KeyRecord  # as the store has it (its secret's digest, never the secret)

    @property
    def owner(self) -> bool:
        """The owner's key: every model, no limits, changed in Access."""
        return self.record.is_owner

    @property
    def editable(self) -> bool:
        return not self.owner and self.state != "revoked"

    @property
    def revocable(self) -> bool:
        return not self.owner and self.state != "revoked"


@dataclass(frozen=True)
class UsageBin:
    """One bar of the chart: what the key (or every key) did in [start, start + seconds)."""

    start: float
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    refusals: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class UsageChart:
    """The chart of one key (or all): `CHART_BINS` bars over `span` minutes up to now."""

    key: str | None  # None: every key
    span: int  # minutes
    bin_seconds: float
    bins: tuple[UsageBin, ...]

    @property
    def peak_tokens(self) -> int:
        return max((b.total_tokens for b in self.bins), default=0)

    @property
    def peak_requests(self) -> int:
        return max((b.requests + b.refusals for b in self.bins), default=0)

    @property
    def total_tokens(self) -> int:
        return sum(b.total_tokens for b in self.bins)

    @property
    def requests(self) -> int:
        return sum(b.requests for b in self.bins)

    @property
    def refusals(self) -> int:
        return sum(b.refusals for b in self.bins)

    @property
    def ticks(self) -> tuple[tuple[float, str], ...]:
        """The time axis: (fraction of the width from the left, label), oldest first."""
        hours = self.span % 60 == 0 and self.span > 60
        unit, size = ("h", self.span // 60) if hours else ("min", self.span)
        return ((0.0, f"−{size} {unit}"), (0.5, f"−{size / 2:g} {unit}"), (1.0, "now"))

    @property
    def summary(self) -> str:
        """The chart in words (its accessible description, and the line under it)."""
        span = dict(CHART_SPANS).get(self.span, f"Last {self.span} minutes").lower()
        who = "" if self.key is None else f" with the key {self.key!r}"
        if not self.requests and not self.refusals:
            return f"No requests{who} in the {span}."
        refused = f" ({self.refusals:,} refused)" if self.refusals else ""
        return (f"{self.requests:,} request{'s' if self.requests != 1 else ''}{who}"
                f"{refused} in the {span}: {self.total_tokens:,} tokens.")


@dataclass(frozen=True)
class KeyTable:
    """Everything the keys panel shows, as of `now`."""

    rows: tuple[KeyRow, ...]
    chart: UsageChart
    named_keys: int  # named keys in the store (revoked ones too)
    owner_key_set: bool

    @property
    def chart_keys(self) -> tuple[str, ...]:
        """The keys the chart may show one of."""
        return tuple(row.name for row in self.rows)

    def row(self, name: str) -> KeyRow | None:
        return next((r for r in self.rows if r.name == name), None)


def key_table(records: Sequence[KeyRecord], usage: Mapping[str, KeyUsage],
              series: Sequence[MinuteUsage], *, owner_key_set: bool,
              chart_key: str | None, span: int, now: float | None = None) -> KeyTable:
    """The panel's picture: the owner's key first (when one is set), then the named keys
    oldest first; `series` is the ledger's minutes of `chart_key` (None: every key)."""
    now = time.time() if now is None else now
    shown = (([OWNER] if owner_key_set else []) + ([OWNER_CHAT] if CHAT_NAME in usage else [])
             + list(records))
    rows = tuple(key_row(record, usage.get(record.name), now) for record in shown)
    return KeyTable(rows, usage_chart(series, chart_key, span, now), len(records),
                    owner_key_set)


def key_row(record: KeyRecord, usage: KeyUsage | None, now: float) -> KeyRow:
    used = usage or KeyUsage()
    wait = used.mean_wait
    if record.is_owner:
        limits = ("all", "-", "-", "-", "-", "-", "never")
        summary = ("The window's Chat tab: the owner's rights, its usage booked apart."
                   if record.name == CHAT_NAME else
                   "The owner's key (Access, on the left): every model, no limits.")
    else:
        limits = (", ".join(record.models) or "all", describe_limit(record.max_concurrent),
                  describe_limit(record.tokens_per_minute),
                  describe_limit(record.tokens_per_day), record.priority.value,
                  f"{record.weight:g}",
                  describe_time(record.expires_at) if record.expires_at else "never")
        summary = f"{record.name}: {describe_key(record)}."
    state = record.status(now)
    cells = (record.name, *limits, state, f"{used.requests:,}", f"{used.prompt_tokens:,}",
             f"{used.completion_tokens:,}", f"{wait:.2f} s" if wait is not None else "-",
             f"{sum(used.refusals.values()):,}",
             describe_recent(used.last_used, now) if used.last_used else "never")
    return KeyRow(record.name, state, cells, summary, dict(used.refusals), record)


def describe_limit(value: int | None) -> str:
    return f"{value:,}" if value else "no limit"


# --- the chart -------------------------------------------------------------------------


def usage_chart(series: Iterable[MinuteUsage], key: str | None, span: int,
                now: float | None = None, bins: int = CHART_BINS) -> UsageChart:
    """`series`' minutes summed into `bins` bars over the last `span` minutes, the last
    bar ending with the current minute."""
    now = time.time() if now is None else now
    if span < 1 or bins < 1:
        raise ValueError("a chart spans at least a minute, in at least one bar")
    end = (math.floor(now / 60) + 1) * 60.0
    start = end - span * 60.0
    width = span * 60.0 / bins
    sums = [[0, 0, 0, 0] for _ in range(bins)]
    for minute in series:
        if not start <= minute.start < end:
            continue
        into = sums[min(bins - 1, int((minute.start - start) // width))]
        into[0] += minute.requests
        into[1] += minute.prompt_tokens
        into[2] += minute.completion_tokens
        into[3] += minute.refusals
    return UsageChart(key, span, width, tuple(
        UsageBin(start + i * width, *counts) for i, counts in enumerate(sums)))


def short_number(value: float) -> str:
    """A chart's scale label: 950, 1.2k, 12k, 3.4M."""
    if value >= 10_000_000:
        return f"{value / 1_000_000:.0f}M"
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}"


# --- client set-up ---------------------------------------------------------------------


def key_target(target: ClientTarget, record: KeyRecord, secret: str) -> ClientTarget:
    """`target` (the port's models, its address) for the holder of `record`: its secret,
    and only the models it may use, the default one first when allowed."""
    # A key limited to some models gets their own names: the default's alias could name
    # one it may not use after the next swap.
    allowed = [(dataclasses.replace(m, model_id=m.served, alias_of="") if record.models else m)
               for m in target.models if record.allows(m.served)]
    if not allowed:
        # None of the models served now: name the first the key lists (a pattern such
        # as "qwen*" names no model, so the default stays as a placeholder then).
        plain = next((m for m in record.models if not any(c in m for c in "*?[")), None)
        allowed = [ClientModel(plain)] if plain else [target.default]
    first, *others = allowed
    small = target.small_model if any(m.served == target.small_model for m in allowed) else ""
    return dataclasses.replace(target, model_id=first.served,
                               context_length=first.context_length, size=first.size,
                               others=tuple(others), small_model=small, api_key=secret,
                               default_alias=first.model_id if first.alias_of else "")


def client_setup(target: ClientTarget, record: KeyRecord) -> dict[str, Any]:
    """What a client holding `record` needs to know of the port's models (`target`: the
    window's snippets are made of the same), without the address and the secret: what
    the enrolment endpoint hands a teammate's `connect` with its key."""
    target = key_target(target, record, "")
    return {"model_id": target.model_id, "context_length": target.context_length,
            "default_alias": target.default_alias, "small_model": target.small_model,
            "max_output_tokens": target.max_output_tokens,
            "default_output_tokens": target.default_output_tokens,
            "others": [{"model_id": m.model_id, "context_length": m.context_length}
                       for m in target.others]}


# --- checks ----------------------------------------------------------------------------


def _whole_limit(value: int, what: str) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KeyStoreError(f"The {what} {value!r} is not usable: give a whole number, or 0 "
                            "for no limit.")
    return value or None


def _priority(value: str) -> Priority:
    try:
        return Priority(value)
    except ValueError:
        raise KeyStoreError(f"The priority {value!r} is not one of "
                            f"{', '.join(p.value for p in Priority)}.") from None


def _weight(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise KeyStoreError(f"The key's weight must be a number above 0, not {value!r}.")
    return float(value)

