"""The engine's account of one model, under that model's own heading in the window:
plain words first (is it served, how many requests at once, how long each, where it
runs and the memory it took), the engine's detail after (asked slots against given, the
cache's layout, prefixes, measured speed and batch, the last residency decision).

The window asks for the model selected in its list: its own engine's snapshot and its
pool status, never the default model's (with Gemma selected and SmolLM2 serving, Gemma's
heading says Gemma is not loaded, and what serves instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backend.app.pool.pool_status import ModelStatus, Residency
from backend.llama.load import THREADS_HELP, Snapshot, State
from backend.llama.report import EngineReport
from backend.llama.supervisor import default_threads
from backend.memory_size import format_memory

__all__ = ["ModelAccount", "model_account"]


@dataclass(frozen=True)
class ModelAccount:
    """What the model pane says of one model."""

    #: One line in plain words: "Ready — 4 requests at once, up to 8,192 tokens each;
    #: on the CPU, 277 MiB".
    headline: str
    #: The engine's detail, one line each, shown on request.
    details: tuple[str, ...] = ()
    #: Loading or unloading: the pane shows progress.
    busy: bool = False
    #: In memory or on its way: Unload applies to it.
    loaded: bool = False
    #: The engine gave another number of slots than asked for.
    slots_differ: bool = False


def model_account(snapshot: Snapshot | None, status: ModelStatus | None, *,
                  serving: Sequence[str] = (), parking: str = "") -> ModelAccount:
    """The account of one model: its own engine's `snapshot` and its pool `status` (None:
    the pool does not serve it), with the other models `serving` now for one that is not
    loaded; `parking`: what parking does for it on its engine
    (`backend.app.pool.parking_steward.ParkingSteward.ability`)."""
    state = snapshot.state if snapshot is not None else State.STOPPED
    decision = (f"Last decision: {status.decision}.",) if status is not None and status.decision \
        else ()
    if state is State.READY and snapshot is not None and snapshot.serving is not None:
        return _ready(snapshot, status, decision, parking)
    if state is State.STARTING and snapshot is not None:
        if snapshot.restarting:
            return ModelAccount(f"Restarting — {snapshot.error or 'its engine stopped unexpectedly.'}",
                                decision, busy=True, loaded=True)
        return ModelAccount("Loading…", decision, busy=True, loaded=True)
    if state is State.STOPPING:
        return ModelAccount("Unloading…", decision, busy=True)
    if state is State.FAILED or (status is not None and status.residency is Residency.FAILED):
        error = (snapshot.error if snapshot is not None else None) or \
            (status.error if status is not None else None) or "it did not load."
        return ModelAccount(f"Failed — {error}", decision)
    if status is not None:
        if status.residency in (Residency.LOADING, Residency.READY):  # an engine elsewhere's
            return ModelAccount("Served by an engine elsewhere." if not status.local
                                else "Loading…", decision, loaded=status.local)
        return ModelAccount("Not loaded now — it loads again on its next request"
                            + (" (the default model)." if status.default else "."), decision)
    others = [name for name in serving]
    if others:
        return ModelAccount(f"Not loaded. Serving now: {', '.join(others)}. Load asks whether "
                            "to add it beside or replace the default model.")
    return ModelAccount("Not loaded. Press Load to serve it.")


# --- helpers ------------------------------------------------------------------------------

def _ready(snapshot: Snapshot, status: ModelStatus | None,
           decision: tuple[str, ...], parking: str) -> ModelAccount:
    serving = snapshot.serving
    assert serving is not None
    slots = serving.slots
    each = serving.per_request
    words = f"{slots} request{'s' if slots != 1 else ''} at once"
    if each:
        words += f", up to {each:,} tokens each"
    report = snapshot.engine
    if report is not None:
        words += "; " + _where(report)
    default = " (the default model)" if status is not None and status.default else ""
    requested = snapshot.requested.parallel if snapshot.requested else None
    differs = requested is not None and requested != "auto" and int(requested) != slots
    details = [f"Parallel slots: {slots}" + (
        f" — you asked for {requested}; llama-server decided otherwise" if differs
        else " (chosen by llama-server)" if requested == "auto" else "")]
    if snapshot.requested is not None and (report is None or not report.on_gpu
                                           or snapshot.requested.threads):
        asked = snapshot.requested.threads
        details.append(f"CPU threads: {asked or default_threads()}"
                       + ("" if asked else f" (Auto: {THREADS_HELP})"))
    for line in (serving.describe_kv(), serving.prefix_note, parking,
                 serving.speed.describe() if serving.speed is not None else None):
        if line:
            details.append(line)
    if report is not None:
        runs = f"Runs on {report.summary()}"
        if report.context_size:
            runs += f"; context {report.context_size:,} tokens in total, as the engine chose it"
            if report.context_reduced_from:
                runs += f" (shrunk from {report.context_reduced_from:,} to fit the memory)"
        details.append(runs + ".")
    for note in (serving.kv_note, serving.prefix_warning):
        if note:
            details.append(note)
    return ModelAccount(f"Ready{default} — {words}", (*details, *decision), loaded=True,
                        slots_differ=differs)


def _where(report: EngineReport) -> str:
    """Where its layers run and the memory they took, in one unit."""
    if report.on_gpu:
        names = ", ".join(d.name for d in report.gpu_devices)
        where = f"{report.layers_offloaded} of {report.layers_total} layers on {names}" \
            if report.layers_offloaded != report.layers_total else f"on {names}"
    else:
        where = "on the CPU"
    used = sum(d.total_mib for d in report.devices)
    return where + (f", {format_memory(int(used * (1 << 20)))}" if used else "")
