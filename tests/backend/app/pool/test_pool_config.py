"""The pool's configuration as values: the names a model answers to, one way only, the
command line's models over the file's, and keys that never show."""

from __future__ import annotations

import pytest

from backend.app.pool.pool_config import ModelEntry, PoolConfig, UpstreamEntry
from backend.errors import SettingsError
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSettings
from backend.models.download import download_model
from backend.models.hub import list_repo, parse_pull_target, pick_choice
from backend.models.model_names import file_names
from tests.conftest import CODER_REPO, SPLIT_REPO


def test_a_file_in_the_hugging_face_cache_answers_to_repo_and_quantization_as_pull_takes_them(hf_hub):
    pulled = {}
    for repo in (CODER_REPO, SPLIT_REPO):
        listing = list_repo(repo)
        choice = pick_choice(listing, "Q8_0")
        pulled[repo] = download_model(choice, listing.commit)

    coder = ModelEntry.for_file(pulled[CODER_REPO])
    split = ModelEntry.for_file(pulled[SPLIT_REPO])
    config = PoolConfig((coder, split))

    assert coder.name == "Tiny-Coder-Q8_0"
    assert config.names(coder) == ("Tiny-Coder-Q8_0", "Tiny-Coder-Q8_0.gguf", f"{CODER_REPO}:Q8_0")
    assert pulled[SPLIT_REPO].name == "Split-Coder-Q8_0-00001-of-00002.gguf"
    assert config.names(split) == ("Split-Coder-Q8_0", "Split-Coder-Q8_0-00001-of-00002",
                                   "Split-Coder-Q8_0-00001-of-00002.gguf", f"{SPLIT_REPO}:Q8_0")
    assert parse_pull_target(config.names(coder)[-1]) == (CODER_REPO, "Q8_0")  # the same words
    assert config.resolve(f"{CODER_REPO.lower()}:q8_0") is coder


def test_names_outside_the_cache_are_the_file_names_only():
    assert file_names("/home/me/models--not/a/cache/Model-Q4_K_M.gguf") == ("Model-Q4_K_M",
                                                                           "Model-Q4_K_M.gguf")
    assert file_names("/x/models--o--r/snapshots/c/sub/M-Q5_K_M.gguf") == (
        "M-Q5_K_M", "M-Q5_K_M.gguf", "o/r:Q5_K_M")
    assert file_names("/x/models--o--r/snapshots/c/readme-model.gguf") == (
        "readme-model", "readme-model.gguf")  # no quantization in the name


def test_a_name_clashing_across_the_command_line_and_the_file_names_both():
    from_file = PoolConfig((ModelEntry.for_file("/m/a.gguf", "coder"),))
    from_flags = PoolConfig((ModelEntry.for_file("/m/b.gguf", "coder"),))
    with pytest.raises(SettingsError, match=r"The name 'coder' is given to two models: "
                       r"coder \(a\.gguf\) and coder \(b\.gguf\)\."):
        from_file.merge(from_flags)


def test_a_name_given_explicitly_wins_over_another_models_file_name():
    config = PoolConfig((ModelEntry.for_file("/m/qwen.gguf", "coder"),
                         ModelEntry.for_file("/m/other.gguf", "qwen")))
    assert config.resolve("qwen") is config.models[1]
    assert config.names(config.models[0]) == ("coder", "qwen.gguf")


def test_the_key_never_shows_in_a_printed_configuration():
    config = PoolConfig(upstreams=(UpstreamEntry("http://h:1", "sk-do-not-print"),))
    assert "sk-do-not-print" not in repr(config)


def test_an_embeddings_entry_and_the_flag_in_its_extra_args_are_the_same_thing():
    flagged = ModelEntry.for_file("/m/e.gguf", settings=LoadSettings(extra_args=("--embedding",)))
    assert flagged.embeddings
    stated = ModelEntry.for_file("/m/e.gguf", embeddings=True, settings=LoadSettings(parallel="2"))
    assert stated.settings.extra_args == ("--embeddings",)
    assert stated.to_spec().settings.extra_args == ("--embeddings",)


def test_merging_adds_the_command_lines_models_and_lets_its_choices_win():
    from_file = PoolConfig((ModelEntry.for_file("/m/coder.gguf", "coder", pinned=True),),
                           (UpstreamEntry("http://h:1", "sk-file", KvLayout.SPLIT),),
                           default_model="coder", memory_limit_mib=1000)
    from_flags = PoolConfig((ModelEntry.for_file("/m/coder.gguf"),  # the same file, unnamed
                             ModelEntry.for_file("/m/small.gguf")),
                            (UpstreamEntry("http://h:1/v1", kv_layout=KvLayout.UNIFIED),
                             UpstreamEntry("http://h:2")),
                            default_model="small", memory_limit_mib=0)
    merged = from_file.merge(from_flags)
    assert [m.name for m in merged.models] == ["coder", "small"]
    assert merged.models[0].pinned  # the file's entry, not a second copy
    assert [(u.url, u.api_key, u.kv_layout) for u in merged.upstreams] == [
        ("http://h:1", "sk-file", KvLayout.UNIFIED), ("http://h:2", None, None)]
    assert (merged.default_model, merged.memory_limit_mib) == ("small", 1000)
    # A file named anew on the command line is a second model of its own.
    renamed = from_file.merge(PoolConfig((ModelEntry.for_file("/m/coder.gguf", "coder-long"),)))
    assert [m.name for m in renamed.models] == ["coder", "coder-long"]
