"""One naming rule: what a request may call a model, the same for the models file, the pool
and the window; clashes named, never a traceback."""

from __future__ import annotations

import pytest

from backend.errors import SettingsError
from backend.models.model_names import DEFAULT_MODEL_ALIAS, ModelNames, NamedModel, check_name


def test_a_model_answers_to_its_name_aliases_and_file_names_regardless_of_case():
    names = ModelNames([NamedModel("coder", ("qwen",), "/m/Qwen2.5-Coder-Q4_K_M.gguf")])
    for asked in ("coder", "CODER", "Qwen", "qwen2.5-coder-q4_k_m", "Qwen2.5-Coder-Q4_K_M.gguf"):
        assert names.resolve(asked) == "coder"
    assert names.resolve("gpt-4o") is None
    assert names.names_of("coder") == ("coder", "qwen", "Qwen2.5-Coder-Q4_K_M",
                                       "Qwen2.5-Coder-Q4_K_M.gguf")


def test_two_models_whose_files_share_a_name_are_asked_for_by_their_own_names():
    names = ModelNames([NamedModel("a", (), "/x/a/model.gguf"), NamedModel("b", (), "/x/b/model.gguf")])
    assert (names.resolve("a"), names.resolve("B")) == ("a", "b")
    assert names.resolve("model") is None and names.resolve("model.gguf") is None
    assert names.names_of("a") == ("a",)


def test_a_name_given_to_two_models_names_both_whatever_the_case():
    with pytest.raises(SettingsError) as raised:
        ModelNames([NamedModel("a", ("shared",), "/x/a.gguf"), NamedModel("b", ("SHARED",), "/x/b.gguf")])
    assert str(raised.value) == "The name 'SHARED' is given to two models: a (a.gguf) and b (b.gguf)."


def test_a_clash_is_described_the_way_the_caller_knows_its_models():
    models = [NamedModel("a", (), "/x/a.gguf"), NamedModel("A", (), "/x/b.gguf")]
    with pytest.raises(SettingsError, match=r"given to two models: model 1, line 2 and model 2, line 5\.$"):
        ModelNames(models, describe=lambda i, _name: f"model {i + 1}, line {[2, 5][i]}")


def test_a_given_name_wins_over_another_models_file_name():
    names = ModelNames([NamedModel("coder", (), "/m/qwen.gguf"), NamedModel("qwen", (), "/m/other.gguf")])
    assert names.resolve("qwen") == "qwen"
    assert names.names_of("coder") == ("coder", "qwen.gguf")


def test_default_means_the_default_model_unless_a_model_is_given_that_name():
    plain = ModelNames([NamedModel("tiny", (), "/m/tiny.gguf")])
    assert plain.is_default_alias("default") and plain.is_default_alias("Default")
    assert not plain.is_default_alias("tiny") and plain.resolve(DEFAULT_MODEL_ALIAS) is None
    # A file called default.gguf does not take the alias from the default model...
    filed = ModelNames([NamedModel("x", (), "/m/default.gguf")])
    assert filed.is_default_alias("default") and filed.resolve("default.gguf") == "x"
    # ...but a model the operator named so keeps its name.
    named = ModelNames([NamedModel("tiny", ("default",), "/m/tiny.gguf")])
    assert not named.is_default_alias("default") and named.resolve("default") == "tiny"


def test_an_engine_elsewhere_joins_a_local_model_of_its_name_and_never_takes_anothers_names():
    names = ModelNames([NamedModel("coder", ("qwen",), "/m/coder.gguf")],
                       guests=[NamedModel("coder", ("big",)), NamedModel("qwen", ()),
                               NamedModel("llama", ("CODER",))])
    assert names.resolve("big") == "coder"  # the same model, served here and there
    assert names.resolve("qwen") == "coder"  # the local alias stays the local model's
    assert names.resolve("llama") == "llama" and names.resolve("coder") == "coder"


@pytest.mark.parametrize("name", ["", " a", "a\x1b[2J", "x" * 257, 3])
def test_a_name_must_be_printable_text(name):
    with pytest.raises(SettingsError):
        check_name(name, "A model's name")
