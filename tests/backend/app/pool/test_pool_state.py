"""The words the window shows for the pool: where a model runs, its slots and KV in use,
its requests, an engine elsewhere's health, and which of a model's buttons make sense."""

from __future__ import annotations

import pytest

from backend.app.pool.pool_status import EngineStatus, ModelStatus, Residency, UpstreamStatus
from backend.app.pool.pool_state import (PoolState, describe_health, describe_kv, describe_requests,
                                    describe_slots, describe_where, model_actions)
from backend.port.metrics import ModelTotals


def engine(where: str = "this machine", *, state: str = "ready", slots: int | None = 2,
           total: int | None = 4096, active: int = 0, reserved: int = 0) -> EngineStatus:
    kv: dict[str, object] | None = (None if total is None else
                                    {"total": total, "per_request": total // 2, "unified": False})
    return EngineStatus(f"id-{where}", where, state, slots, kv, active, 0, reserved)


def model(name: str = "m", residency: Residency = Residency.READY, *, local: bool = True,
          engines: tuple[EngineStatus, ...] = ()) -> ModelStatus:
    return ModelStatus(name, (), local, residency, False, 0.0, False, False, None, "", None,
                       engines)


def test_a_model_runs_where_its_engines_are_and_nowhere_while_none_serves_it() -> None:
    assert describe_where((engine(), engine("upstream 2"))) == "this machine, upstream 2"
    assert describe_where(()) == "—"


def test_slots_and_kv_in_use_add_up_over_the_engines_that_serve() -> None:
    both = (engine(active=1, reserved=600), engine("upstream 1", slots=4, total=8192, active=3,
                                                   reserved=2000))
    assert describe_slots(both) == "4 / 6"
    assert describe_kv(both) == "2,600 / 12,288"
    assert describe_slots(engine(active=2)) == "2 / 2"


def test_an_engine_that_does_not_serve_shows_dashes() -> None:
    idle = engine(state="starting", slots=None, total=None)
    assert describe_slots(idle) == "—"
    assert describe_kv(idle) == "—"
    assert describe_slots((idle, engine(active=1))) == "1 / 2"


@pytest.mark.parametrize("residency, load, unload, remove", [
    (Residency.UNLOADED, True, False, True),
    (Residency.LOADING, False, True, True),
    (Residency.READY, False, True, True),
    (Residency.UNLOADING, False, False, False),
    (Residency.EVICTED, True, False, True),
    (Residency.FAILED, True, False, True),
])
def test_a_local_models_buttons_follow_its_state(residency: Residency, load: bool, unload: bool,
                                                 remove: bool) -> None:
    actions = model_actions(model(residency=residency))
    assert (actions.load, actions.unload, actions.remove, actions.options) == (load, unload,
                                                                               remove, True)


def test_a_model_served_elsewhere_is_managed_where_it_runs() -> None:
    actions = model_actions(model(local=False, engines=(engine("upstream 1"),)))
    assert not (actions.load or actions.unload or actions.remove or actions.options)


def test_an_engine_elsewhere_says_ready_checking_or_why_it_is_out() -> None:
    def upstream(state: str, error: str | None) -> UpstreamStatus:
        return UpstreamStatus("http://h:8080", None, error, (), engine("upstream 1", state=state))

    assert describe_health(upstream("ready", None)) == "ready"
    assert describe_health(upstream("starting", None)) == "checking…"
    assert describe_health(upstream("starting", "The upstream does not answer.")) == \
        "out of the pool — The upstream does not answer."


def test_the_picture_finds_models_and_engines_by_name_and_address() -> None:
    there = UpstreamStatus("http://h:8080", "split", None, ("far",), engine("upstream 1"))
    state = PoolState((model("a"), model("b")), (there,))
    assert state.model("b") is state.models[1]
    assert state.model("c") is None
    assert state.upstream("http://h:8080") is there
    assert state.upstream("http://other:8080") is None


def test_a_models_requests_say_how_many_and_only_the_refusals_and_cancellations_it_had() -> None:
    assert describe_requests(ModelTotals(answered=1234)) == "1,234"
    assert describe_requests(ModelTotals(answered=12, refused=1, cancelled=2)) == "12, 1 refused, 2 stopped by the client"
    assert describe_requests(ModelTotals(answered=3, cancelled=1)) == "3, 1 stopped by the client"
    assert describe_requests(None) == "—"  # a picture taken without the port's counts
