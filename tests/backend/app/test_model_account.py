"""The engine's account under one model's heading: its own engine, in plain words first."""

from __future__ import annotations

from backend.app.model_account import model_account
from backend.app.pool.pool_status import ModelStatus, Residency
from backend.llama.engine_speed import BatchChoice, EngineSpeed, SpeedModel
from backend.llama.kv_capacity import KvCapacity
from backend.llama.load import LoadSettings, Serving, Snapshot, State
from backend.llama.report import DeviceUse, EngineReport


def status(name: str, residency: Residency, *, default: bool = False,
           decision: str = "") -> ModelStatus:
    return ModelStatus(name, (), True, residency, False, 0.0, False, default, 8192, decision,
                       None, ())


def test_a_model_not_served_says_so_and_what_serves_instead() -> None:
    """Gemma selected while SmolLM2 serves: Gemma's heading does not read as if Gemma were
    ready."""
    account = model_account(None, None, serving=["smol"])
    assert account.headline.startswith("Not loaded. Serving now: smol.")
    assert not account.loaded and not account.busy
    assert model_account(None, None).headline == "Not loaded. Press Load to serve it."


def test_a_ready_model_is_told_in_plain_words_and_the_engine_detail_after() -> None:
    speed = EngineSpeed(224.0, 0.009, SpeedModel(0.004, 1e-7, 0.009),
                        BatchChoice(128, 128, "the smallest that keeps a prompt on whole "
                                              "attention tiles"), 1.4)
    report = EngineReport("cpu", (DeviceUse("CPU", model_mib=90.0, kv_mib=180.0, compute_mib=7.0),),
                          layers_offloaded=0, layers_total=31, context_size=8192)
    snapshot = Snapshot(state=State.READY, model_id="smol", engine=report,
                        serving=Serving("http://e", 4, 8192, kv=KvCapacity(8192, 8192, unified=True),
                                        speed=speed),
                        requested=LoadSettings(parallel="auto"))
    account = model_account(snapshot, status("smol", Residency.READY, default=True,
                                             decision="loaded on request: needs about 277 MiB"))
    assert account.headline == ("Ready (the default model) — 4 requests at once, up to 8,192 "
                                "tokens each; on the CPU, 277 MiB")
    assert "attention tiles" not in account.headline
    assert account.details[0] == "Parallel slots: 4 (chosen by llama-server)"
    # The threads chosen, said: Auto is every core but one.
    assert account.details[1].startswith("CPU threads: ") and "every core but one" in account.details[1]
    assert any("attention tiles" in line for line in account.details)
    assert account.details[-1] == "Last decision: loaded on request: needs about 277 MiB."
    assert account.loaded and not account.slots_differ


def test_an_evicted_model_loads_again_on_demand_and_a_failed_one_says_why() -> None:
    evicted = model_account(Snapshot(), status("coder", Residency.EVICTED,
                                               decision="evicted to make room for smol"))
    assert evicted.headline == "Not loaded now — it loads again on its next request."
    assert evicted.details == ("Last decision: evicted to make room for smol.",)
    failed = model_account(Snapshot(state=State.FAILED, error="out of memory."),
                           status("coder", Residency.FAILED))
    assert failed.headline == "Failed — out of memory."
    loading = model_account(Snapshot(state=State.STARTING), status("coder", Residency.LOADING))
    assert loading.headline == "Loading…" and loading.busy and loading.loaded
