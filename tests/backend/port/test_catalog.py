"""What /v1/models lists: every model, and the default one under a name that survives a swap."""

from __future__ import annotations

from backend.port.catalog import ModelCard, model_list


def test_the_default_model_is_listed_again_as_default_naming_which_it_is():
    cards = [ModelCard("coder", "ready", 8192, 8192, default=True), ModelCard("small", "unloaded", None, None)]
    listed = model_list(cards, created=1)
    assert [(m["id"], m.get("alias_of")) for m in listed] == [
        ("coder", None), ("small", None), ("default", "coder")]
    assert listed[-1]["context_length"] == 8192 and listed[-1]["state"] == "ready"


def test_no_alias_without_a_default_model_or_when_a_model_is_given_the_name():
    assert model_list([ModelCard("small", "ready", None, None)], created=1)[-1]["id"] == "small"
    named = [ModelCard("coder", "ready", None, None, default=True),
             ModelCard("x", "ready", None, None, details={"aliases": ["Default"]})]
    assert [m["id"] for m in model_list(named, created=1)] == ["coder", "x"]
