"""Capacity in KV tokens: the engine's cache, and what one request needs of it.

Plain values, read by `backend.admission` to decide and by the metrics and the window
to show; `backend.prompt_tokens` makes the needs.

Where the capacity comes from after a healthy load:

- **a supervised engine** (`kv_from_load`, from what `backend.engine_report` read of
  llama-server's own load output).  At its default verbosity it prints `initializing,
  n_slots = N, n_ctx_slot = S, kv_unified = 'true'`; S is one request's limit (already
  capped by `--kv-unified-per-slot` and the model's training context).  A split cache
  holds N x S.  A unified pool holds llama_context's `n_ctx`, printed at verbosity 4
  (`llama_context: n_ctx = T`) and otherwise only when a cap made S smaller than the
  pool (`capping per-slot context (T) to --kv-unified-per-slot`, or `the slot context
  (T) exceeds the training context of the model` when the model was trained on less
  than the pool); without any of those lines the pool is taken as S, which is exact
  when nothing capped S (the common case) and too small, never too large, otherwise.
- **an attached engine** (`kv_from_props`): its `/props` gives only the slots and S,
  not whether the cache is shared.  The only rule safe for both kinds is one pool of S
  tokens: every request may use its whole limit, and requests run together only while
  their needs sum to S.  A split cache would have allowed more; nothing is ever over-
  committed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KvCapacity", "TokenNeed", "kv_from_load", "kv_from_props", "planned_capacity"]


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

    def describe(self, slots: int) -> str:
        """For people: "up to 4 requests at once; each up to 16,384 tokens (one shared
        pool of 16,384)"."""
        pool = (f"one shared pool of {self.total:,}" if self.unified
                else f"{self.per_request:,} reserved for each")
        return (f"up to {slots} request{'s' if slots != 1 else ''} at once; each up to "
                f"{self.per_request:,} tokens ({pool})")

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


def kv_from_props(per_slot_context: int | None) -> KvCapacity | None:
    """The conservative cache of an attached engine: one pool of one slot's context."""
    if not per_slot_context or per_slot_context < 1:
        return None
    return KvCapacity.shared(per_slot_context)


@dataclass(frozen=True, slots=True)
class TokenNeed:
    """What one request may hold in the KV cache: its prompt plus its output budget."""

    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


def planned_capacity(ctx_size: int, parallel: str, trained: int | None,
                     extra_args: tuple[str, ...] = ()) -> tuple[int, KvCapacity] | None:
    """(slots, cache) llama-server will give a load, by its own rules, before loading.

    Auto slots: 4 sharing one pool (--kv-unified); a number of slots: each its own
    share (unless --kv-unified is among the extra arguments).  Context 0: the model's
    trained context.  The pool is rounded up to 256, a split share too; one request
    never exceeds the trained context nor --kv-unified-per-slot.  None when the
    trained context is unknown and needed.  `--fit` may still shrink the context to
    fit the memory: what the engine really gave is read after the load.
    """
    auto = str(parallel) in ("", "auto", "0", "-1")
    slots = 4 if auto else max(1, int(parallel))
    unified = auto or any(a in ("--kv-unified", "-kvu") for a in extra_args)
    if any(a in ("--no-kv-unified", "-no-kvu") for a in extra_args):
        unified = False
    total = ctx_size or trained
    if not total:
        return None
    total = _pad(total)
    limit = trained or total
    per_slot_cap = _flag_value(extra_args, "--kv-unified-per-slot")
    if unified:
        per_request = min(total, limit, per_slot_cap or total)
        return slots, KvCapacity.shared(total, max(1, per_request))
    share = _pad(total // slots)
    return slots, KvCapacity(share * slots, max(1, min(share, limit)), unified=False)


def _pad(n: int) -> int:
    return (n + 255) // 256 * 256


def _flag_value(args: tuple[str, ...], flag: str) -> int:
    for index, arg in enumerate(args):
        value = None
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit():
            return int(value)
    return 0


def _whole(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)
