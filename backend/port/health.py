"""What `GET /health` says (`health_answer`): 200 while the default model has an engine
that serves, else 503.  The top-level fields are that model's: its serving engines' slots
and cache together, so one engine out of several leaves it ready (and named in
`engines_out`).  A client that may not read all of it (off this machine without the key,
on a port that has one: the gateway decides) is told the state only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from backend.admission.admission_registry import AdmissionRegistry
from backend.llama.load import Snapshot, State
from backend.port.catalog import ModelCard
from backend.port.metrics import Metrics

if TYPE_CHECKING:
    from backend.port.enrolment_endpoint import EnrolmentEndpoint

__all__ = ["HealthContext", "health_answer"]


class HealthContext(Protocol):
    """What /health reads of the port (`gateway.GatewayContext` has it all)."""

    registry: AdmissionRegistry
    metrics: Metrics

    def snapshot(self) -> Snapshot:
        """The default model's engine."""

    def model_cards(self) -> list[ModelCard]:
        """Every model served or loadable."""

    def engines_elsewhere(self) -> list[dict[str, Any]]:
        """Every engine elsewhere, serving or not: "upstream N", never its address."""


def health_answer(ctx: HealthContext, enrolment: EnrolmentEndpoint | None,
                  may_read: Callable[[], bool]) -> tuple[dict[str, Any], int]:
    """/health's body and status; all of it when `may_read()`, else the state only."""
    cards = ctx.model_cards()
    elsewhere = ctx.engines_elsewhere()
    default = next((card for card in cards if card.default), None)
    summary = _default_model_health(default, ctx.snapshot(), ctx.registry.total_reserved_tokens)
    status = 200 if summary["state"] == State.READY.value else 503
    if not may_read():
        return {"state": summary["state"]}, status
    registry = ctx.registry
    snapshot = ctx.snapshot()
    # Out: an engine elsewhere that does not serve and says why (not one that is
    # still starting, nor a GGUF Studio port whose models load on demand there).
    out = [{"engine": e["engine"], "model": (e["models"] or [None])[0], "state": e["state"],
            "error": e["error"]} for e in elsewhere if not e["serving"] and e["error"]]
    out += [{"engine": engine["where"], "model": card.id, "state": engine["state"],
             "error": card.details.get("error")}
            for card in cards for engine in card.details.get("engines", ())
            if engine["id"].startswith("local:") and card.state == "failed"]
    body = {
        **summary,
        # Requests of the whole port, running and waiting.
        "active": registry.total_active,
        "waiting": registry.total_waiting,
        # Engines that should serve and do not: the pool runs on the others meanwhile.
        "degraded": bool(out),
        "engines_out": out,
        # Which backend and devices the engine uses (no paths, ports or URLs in it).
        "engine": snapshot.engine.to_dict() if snapshot.engine else None,
        # Every model, its residency and the reason of its last decision, its engines,
        # its requests since start (as /metrics counts them) and waiting now.
        "models": [{"id": card.id, "state": card.state, "default": card.default,
                    "context_length": card.context_length, **card.details,
                    "requests": _model_requests(ctx, card.id)}
                   for card in cards],
        # Engines on other machines, also those out of the pool right now, and why.
        "upstreams": elsewhere,
    }
    if enrolment is not None:
        # Whether teammates may ask for a key now (the owner reads it: the door's
        # hours are not for everyone's eyes).
        body["enrolment"] = enrolment.window().to_dict()
    return body, status


# --- helpers -----------------------------------------------------------------------------

def _model_requests(ctx: HealthContext, model: str) -> dict[str, int]:
    totals = ctx.metrics.model_totals(model)
    line = ctx.registry.find_line(model)
    return {"answered": totals.answered, "refused": totals.refused,
            "cancelled": totals.cancelled, "waiting": line.waiting if line is not None else 0}


def _default_model_health(card: ModelCard | None, snapshot: Snapshot,
                          reserved: int) -> dict[str, Any]:
    """/health's top-level fields: the default model, as its engines that serve now make
    it together (a port of one engine without a pool: that engine's snapshot)."""
    engines = card.details.get("engines") if card is not None else None
    if card is None or engines is None:
        serving = snapshot.serving
        kv = serving.kv.to_dict() if serving is not None and serving.kv is not None else None
        return {"state": snapshot.state.value, "model": snapshot.model_id,
                "effective_parallel_slots": serving.slots if serving is not None else None,
                "kv": None if kv is None else dict(kv, reserved=reserved),
                "speed": serving.speed.to_dict() if serving is not None and serving.speed else None}
    serving_now = [e for e in engines if e["state"] == State.READY.value and e["slots"]]
    caches = [e["kv"] for e in serving_now if e["kv"] is not None]
    if serving_now:
        state = State.READY.value
    elif snapshot.model_id == card.id and snapshot.state is not State.READY:
        state = snapshot.state.value
    else:
        state = next((e["state"] for e in engines), State.STOPPED.value)
    return {"state": state, "model": card.id,
            "effective_parallel_slots": sum(e["slots"] for e in serving_now) or None,
            "kv": {"total": sum(int(c["total"]) for c in caches),
                   "per_request": max(int(c["per_request"]) for c in caches),
                   "unified": all(c["unified"] is True for c in caches),
                   "reserved": sum(int(e["reserved_tokens"]) for e in serving_now)} if caches else None,
            # The first serving engine's measured speed (each engine's is in `models`).
            "speed": next((e["speed"] for e in serving_now if e.get("speed")), None)}
