"""Capacity in KV tokens: the engine's cache, and what one request needs of it.

Plain values, read by `backend.admission.engine_queue` and `backend.admission.line` to
decide and by the metrics and the window to show; `backend.admission.prompt_tokens` makes
the needs.

Where the capacity comes from after a healthy load:

- **a supervised engine** (`kv_from_load`, from what `backend.llama.report` read of
  llama-server's own load output).  At its default verbosity it prints `initializing,
  n_slots = N, n_ctx_slot = S, kv_unified = 'true'`; S is one request's limit (already
  capped by `--kv-unified-per-slot` and the model's training context).  A split cache
  holds N x S.  A unified pool holds llama_context's `n_ctx`, printed at verbosity 4
  (`llama_context: n_ctx = T`) and otherwise only when a cap made S smaller than the
  pool (`capping per-slot context (T) to --kv-unified-per-slot`, or `the slot context
  (T) exceeds the training context of the model` when the model was trained on less
  than the pool); without any of those lines the pool is taken as S, which is exact
  when nothing capped S (the common case) and too small, never too large, otherwise.
- **an attached llama-server** (`kv_from_props`): its `/props` (and `/slots`) give the
  slots N and S, never whether the cache is shared: `-np 4 -c 16384` reads 4 x 4,096
  split, and `-np 4 -c 4096 --kv-unified` reads the same 4 x 4,096 over a pool of 4,096
  (tests/backend/llama/test_remote_engine.py measures it).  So the operator states the
  layout (`KvLayout`): split holds N x S; unified holds a pool of S (exact unless the
  engine caps a slot with `--kv-unified-per-slot`, when the pool is larger).  Without a
  statement the only rule safe for both is one pool of S tokens: requests run together
  only while their needs sum to S.  Nothing is ever over-committed, but a split cache
  would have run more at once, and `assumed_layout_note` says so.
- **another GGUF Studio port** (`kv_from_health`): its `/health` carries its exact
  capacity in `KvCapacity.to_dict`'s shape.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from backend.errors import SettingsError

__all__ = ["FIT_MIN_CONTEXT", "KvCapacity", "KvLayout", "KvPlan", "LlamaArgs", "TokenNeed",
           "assumed_layout_note", "context_args", "kv_from_health", "kv_from_load", "kv_from_props",
           "planned_capacity"]

#: The least context `--fit` may shrink a "model's own" context to, per stream: llama.cpp's
#: own default for `--fit-ctx`, given explicitly because `-c 0` alone turns shrinking off.
FIT_MIN_CONTEXT = 4096


class KvLayout(enum.Enum):
    """How a llama-server's cache is laid out, as its operator states it (`/props` cannot
    tell): `split` (the default of `-np N`), each slot its own share; `unified`
    (`--kv-unified`, or `-np` left at auto), one pool every slot draws from."""

    SPLIT = "split"
    UNIFIED = "unified"

    @classmethod
    def parse(cls, text: str | None) -> KvLayout | None:
        """'split', 'unified', or '' / None for not stated; a SettingsError otherwise."""
        word = (text or "").strip().lower()
        if not word:
            return None
        try:
            return cls(word)
        except ValueError:
            raise SettingsError(f"An upstream's KV layout is 'split' or 'unified', not {text!r}.") from None


@dataclass(frozen=True, slots=True)
class KvCapacity:
    """The engine's KV cache, in tokens, as read after a healthy load."""

    total: int        #: every slot's tokens together (llama-server's n_ctx)
    per_request: int  #: the most one request may hold (llama-server's n_ctx_slot)
    unified: bool     #: one pool shared by all slots, else a fixed share per slot

    def __post_init__(self) -> None:
        if not (_whole(self.total) and self.total >= 1):
            raise ValueError(f"KV capacity must be at least 1 token, not {self.total!r}")
        if not (_whole(self.per_request) and 1 <= self.per_request <= self.total):
            raise ValueError(f"the per-request limit must be 1..{self.total} tokens, "
                             f"not {self.per_request!r}")

    @classmethod
    def split(cls, total: int, slots: int) -> KvCapacity:
        """A cache cut into `slots` equal shares (llama-server without --kv-unified)."""
        return cls(total, max(1, total // slots), unified=False)

    @classmethod
    def shared(cls, total: int, per_request: int | None = None) -> KvCapacity:
        """One pool (--kv-unified), optionally capped per request (--kv-unified-per-slot)."""
        return cls(total, total if per_request is None else per_request, unified=True)

    def describe(self, slots: int, *, at_most: bool = False) -> str:
        """For people: "up to 4 requests at once; each up to 8,192 tokens; one shared pool
        of 16,384 tokens", or "...; each slot has its own 4,096 tokens" for a split cache.
        `at_most`: the numbers are the most the engine may give."""
        start = f"up to {slots} request{'s' if slots != 1 else ''} at once; "
        if self.unified:
            return (start + f"each up to {self.per_request:,} tokens; one shared pool of "
                    f"{'up to ' if at_most else ''}{self.total:,} tokens")
        if at_most:
            return start + f"each slot has up to {self.per_request:,} tokens of its own"
        return start + f"each slot has its own {self.per_request:,} tokens"

    def to_dict(self) -> dict[str, object]:
        return {"total": self.total, "per_request": self.per_request, "unified": self.unified}


def kv_from_load(slots: int | None, per_slot: int | None, unified: bool,
                 pool: int | None = None, pool_at_least: int = 0) -> KvCapacity | None:
    """The cache a supervised engine reported at its load, or None without its load line.

    `per_slot` is the load line's n_ctx_slot; `pool` llama_context's n_ctx when printed;
    `pool_at_least` the largest lower bound of the pool from the capping messages.
    """
    if per_slot is None or per_slot < 1:
        return None
    n = slots or 1
    if not unified:
        return KvCapacity.split(n * per_slot, n)
    known = pool if pool else max(pool_at_least, per_slot)
    return KvCapacity.shared(max(known, per_slot), per_slot)


def kv_from_props(per_slot_context: int | None, *, slots: int = 1,
                  layout: KvLayout | None = None) -> KvCapacity | None:
    """The cache of a llama-server that reports `slots` slots of `per_slot_context`
    tokens, by the layout its operator stated; without one, one pool of one slot's
    context (never more than the engine has, whichever it is)."""
    if not per_slot_context or per_slot_context < 1:
        return None
    if layout is KvLayout.SPLIT:
        return KvCapacity.split(per_slot_context * max(1, slots), max(1, slots))
    return KvCapacity.shared(per_slot_context)


def assumed_layout_note(kv: KvCapacity, slots: int, layout: KvLayout | None) -> str | None:
    """For the log and the window, when the safe assumption may hold back an engine:
    its layout was not stated and it has more than one slot (one slot is the same
    either way)."""
    if layout is not None or slots <= 1:
        return None
    return (f"KV layout unknown: assuming one shared pool of {kv.total:,} tokens; this limits "
            f"concurrency — state split or unified for this upstream.")


def kv_from_health(data: Any) -> KvCapacity | None:
    """The exact cache another GGUF Studio port gives in its `/health` (`to_dict`'s
    shape); None when it has none or it does not read as one."""
    if not isinstance(data, dict):
        return None
    total, per_request, unified = data.get("total"), data.get("per_request"), data.get("unified")
    if not (isinstance(total, int) and isinstance(per_request, int) and isinstance(unified, bool)):
        return None
    try:
        return KvCapacity(total, per_request, unified)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class TokenNeed:
    """What one request may hold in the KV cache: its prompt plus its output budget."""

    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


@dataclass(frozen=True, slots=True)
class KvPlan:
    """What llama-server will give a load, worked out before loading."""

    slots: int
    kv: KvCapacity
    #: --fit may shrink the context to fit the memory: the numbers are the most it gives
    at_most: bool = False
    fit_floor: int = 0  #: the least --fit shrinks the whole context to, when `at_most`
    #: The cells llama.cpp allocates for each attention layer, every slot's together
    #: (its n_ctx after padding): more than `kv.total` when a slot's share exceeds what
    #: one request may hold (the trained context, --kv-unified-per-slot).  What the
    #: memory depends on, not what clients see, so plans compare without it.
    cells: int = field(default=0, compare=False)

    def describe(self) -> str:
        """For people: "Up to 4 requests at once; each slot has its own 8,192 tokens"."""
        text = self.kv.describe(self.slots, at_most=self.at_most).capitalize() + "."
        if self.at_most:
            text += (f" The engine may give less to fit the memory (not below "
                     f"{self.fit_floor:,} tokens in total).")
        return text


def context_args(ctx_size: int, *, fit: bool) -> list[str]:
    """llama-server's context arguments for a load (its `--fit on|off` comes with the GPU
    layers).  `-c 0` alone would tell --fit the user asked for the whole trained context
    (common/arg.cpp sets fit_params_min_ctx to UINT32_MAX), so a "model's own" context
    that does not fit the memory would fail the load instead of shrinking; the floor
    after it restores llama.cpp's default, letting --fit shrink it down to 4,096 tokens
    per stream.  It also lets `--kv-unified-per-slot N` size the pool to slots x N, as
    llama-server documents for a context left unset."""
    args = ["--ctx-size", str(ctx_size)]
    if ctx_size == 0 and fit:
        args += ["--fit-ctx", str(FIT_MIN_CONTEXT)]
    return args


def planned_capacity(ctx_size: int, parallel: str, trained: int | None,
                     extra_args: tuple[str, ...] = (), *, fit: bool = True) -> KvPlan | None:
    """What llama-server will give a load, by the pinned llama.cpp's own rules.

    The app starts it with `--parallel P --ctx-size C [--fit on|off] EXTRA...`; later
    arguments win, so `-c`, `--fit`, `--fit-ctx`, `--kv-unified` and
    `--kv-unified-per-slot` in `extra_args` count (`context_args` gives the app's own).
    `fit` is False when the GPU layers are "none" (the app passes `--fit off`).  None when the context depends on
    a trained context that is unknown.  The rules, in the order the engine applies them:

    1. tools/server/server.cpp: auto slots (-1) become 4 sharing one pool, whatever
       `--no-kv-unified` says; a number of slots shares only with `--kv-unified`.  A
       context of 0 with `--kv-unified-per-slot N` becomes slots x N, but only when
       `--fit-ctx` came after `-c 0` (`-c 0` itself asks for the full context); the app
       gives one with --fit on (`context_args`).
    2. common/fit.cpp, with --fit on and a context of 0: the model's trained context
       for each stream (one when unified, one per slot when split), so a split cache
       gives every slot the trained context.  It shrinks that to fit the memory, not
       below the `--fit-ctx` floor per stream, unless `-c 0` came last: the plan then
       says "up to".
    3. src/llama-context.cpp: a context of 0 is the trained context in total; the pool
       is padded up to 256; split, each slot gets the pool / slots padded up to 256.
    4. tools/server/server-context.cpp: one slot never exceeds the trained context nor
       `--kv-unified-per-slot`.
    """
    args = LlamaArgs((*context_args(ctx_size, fit=fit), "--fit", "on" if fit else "off", *extra_args))
    auto = str(parallel).strip() in ("", "auto", "0", "-1")
    slots = 4 if auto else max(1, int(parallel))
    unified = True if auto else args.switch(("-kvu", "--kv-unified"), ("-no-kvu", "--no-kv-unified"))
    context, full_context_asked = args.context()
    per_slot_cap = args.number(("--kv-unified-per-slot",)) or 0
    fit_on = args.last(("-fit", "--fit")) != "off"

    if per_slot_cap > 0 and context == 0 and not full_context_asked:
        context = slots * per_slot_cap
    at_most, fit_floor = False, 0
    if context == 0:
        if not trained:
            return None
        streams = 1 if unified else slots
        context = trained * streams if fit_on else trained
        floor = (args.number(("-fitc", "--fit-ctx")) or 0) * streams
        if fit_on and not full_context_asked and context > floor:
            at_most, fit_floor = True, floor
    pool = _pad(context)
    share = pool if unified else _pad(pool // slots)
    per_request = min(share, per_slot_cap or share, trained or share)
    kv = (KvCapacity.shared(pool, per_request) if unified
          else KvCapacity(per_request * slots, per_request, unified=False))
    return KvPlan(slots, kv, at_most, fit_floor, cells=pool if unified else share * slots)


def _pad(n: int) -> int:
    return (n + 255) // 256 * 256


class LlamaArgs:
    """llama-server's command line as its parser reads it: the last value of a flag wins,
    given as `--flag value` or `--flag=value`."""

    def __init__(self, args: tuple[str, ...]) -> None:
        self._pairs: list[tuple[str, str | None]] = []
        for index, arg in enumerate(args):
            name, eq, value = arg.partition("=")
            if eq and name.startswith("-"):
                self._pairs.append((name, value))
            else:
                following = args[index + 1] if index + 1 < len(args) else None
                self._pairs.append((arg, following))

    def last(self, names: tuple[str, ...]) -> str | None:
        found = None
        for name, value in self._pairs:
            if name in names:
                found = value
        return found

    def number(self, names: tuple[str, ...]) -> int | None:
        return _int_or_none(self.last(names))

    def switch(self, on: tuple[str, ...], off: tuple[str, ...]) -> bool:
        state = False
        for name, _ in self._pairs:
            if name in on:
                state = True
            elif name in off:
                state = False
        return state

    def context(self) -> tuple[int, bool]:
        """(context, whether the full context was asked for): `-c 0` disables --fit's
        shrinking, until a later `--fit-ctx` sets a floor again (common/arg.cpp)."""
        context, full = 0, False
        for name, value in self._pairs:
            number = _int_or_none(value)
            if name in ("-c", "--ctx-size") and number is not None:
                context, full = number, number == 0
            elif name in ("-fitc", "--fit-ctx") and number is not None:
                full = False
        return context, full


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _whole(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)
