"""What a load or an unload means for the port's users, said before it happens."""

from __future__ import annotations

from backend.app.model_swap import (RECENT_MINUTES, ServedModel, load_question, quit_question,
                                    served_models, unload_question)
from backend.app.pool.pool_status import ModelStatus, Residency
from backend.keys.key_store import CHAT_NAME
from backend.port.request_log import RequestRecord

NOW = 1_700_000_000.0


def status(name: str, *, default: bool = False, residency: Residency = Residency.READY,
           embeddings: bool = False) -> ModelStatus:
    return ModelStatus(name, (), True, residency, False, 0.0, embeddings, default, 8192, "",
                       None, ())


def record(key: str, model: str, minutes_ago: float, id: int = 1) -> RequestRecord:
    return RequestRecord(id=id, time=NOW - minutes_ago * 60, route="/v1/chat/completions",
                         key=key, model=model)


def test_a_load_while_nothing_else_serves_asks_nothing() -> None:
    assert load_question("smol", []) is None
    # Loading the default model again (other settings) changes no one's model either.
    assert load_question("smol", [ServedModel("smol", True, True, ("alice",))]) is None


def test_the_question_names_the_default_who_used_it_lately_and_what_each_answer_does() -> None:
    served = served_models(
        [status("smol", default=True), status("coder"), status("embed", embeddings=True)],
        [record("alice", "smol", 3), record("bob", "smol", 1), record("alice", "smol", 0.5),
         record(CHAT_NAME, "smol", 1),  # the owner's Chat tab is nobody's agent
         record("carol", "smol", RECENT_MINUTES + 1),  # too long ago
         record("dave", "coder", 2)],
        now=NOW, busy={"smol": 2})
    assert [(m.name, m.users, m.busy) for m in served] == [
        ("smol", ("alice", "bob"), 2), ("coder", ("dave",), 0)]
    question = load_question("gemma", served, takes_chats=False)
    assert question is not None
    assert question.title == "Load gemma while smol serves?"
    assert question.now == ("smol is the default model (2 requests running or waiting now); "
                            f"used in the last {RECENT_MINUTES} minutes by alice and bob. "
                            "Also served: coder.")
    # Replace: teammates' `default` moves, and they are told it takes no chats.
    assert "agents set up with `default`" in question.replace
    assert "get gemma from their next request, which has no chat template: their chats are " \
           "refused" in question.replace
    assert "Requests that name smol are refused" in question.replace
    # Add beside: nothing moves for them.
    assert question.beside.startswith("Add beside: smol keeps serving and stays `default`; "
                                      "gemma is served beside it by its name")
    assert question.make_default.startswith("…and make gemma the default: agents set up with")


def test_a_model_nobody_used_says_so() -> None:
    served = served_models([status("smol", default=True, residency=Residency.EVICTED)], [], now=NOW)
    question = load_question("coder", served)
    assert question is not None
    assert question.now == ("smol is the default model (not loaded now); nobody used it in the "
                            f"last {RECENT_MINUTES} minutes.")
    assert "no chat template" not in question.replace


def test_unloading_the_default_asks_which_model_default_names_only_when_others_serve() -> None:
    alone = [ServedModel("smol", True, True)]
    assert unload_question("smol", alone) is None
    served = [ServedModel("smol", True, True, ("alice",)), ServedModel("coder", False, True)]
    assert unload_question("coder", served) is None  # not the default: `default` stays
    question = unload_question("smol", served)
    assert question is not None and question.others == ("coder",)
    assert question.title == "Unload smol, the default model?"
    assert "used in the last 10 minutes by alice" in question.text
    assert "with none, their requests are refused until you load one" in question.text


def test_quitting_asks_while_requests_run_or_teammates_used_the_port_lately() -> None:
    assert quit_question([], now=NOW, busy=0) is None
    assert quit_question([record(CHAT_NAME, "smol", 1), record("alice", "smol", 30)],
                         now=NOW, busy=0) is None  # the owner's chat; alice long ago
    said = quit_question([record("alice", "smol", 3), record("bob", "coder", 1)], now=NOW, busy=2)
    assert said == ("2 requests are running or waiting; quitting ends them. alice and bob used "
                    f"the port in the last {RECENT_MINUTES} minutes: their agents get no answer "
                    "until GGUF Studio runs again and a model is loaded.")

    # On a port this computer alone reaches, the owner's key and keyless requests are its
    # own programs': named keys only.
    local = [record("owner", "smol", 1), record("anonymous", "smol", 1)]
    assert quit_question(local, now=NOW, busy=0, shared=False) is None
    named = quit_question([*local, record("alice", "smol", 1)], now=NOW, busy=0, shared=False)
    assert named is not None and named.startswith("alice used the port")
