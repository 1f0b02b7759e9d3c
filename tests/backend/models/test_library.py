"""The model library: what it finds on disk, what it remembers, how it sorts and searches."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from backend.errors import SettingsError
from backend.llama.load import LoadSettings
from backend.models.library import (
    Location,
    ModelLibrary,
    default_locations,
    find_gguf_files,
    search,
)


def touch(path: Path, size: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + b"\0" * (size - 4))
    return path


def test_finds_models_in_the_usual_places(tmp_path: Path) -> None:
    home = tmp_path / "home"
    hub = home / ".cache" / "huggingface" / "hub"
    blob = touch(hub / "models--bartowski--Qwen-GGUF" / "blobs" / "abc123")
    snapshot = hub / "models--bartowski--Qwen-GGUF" / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "Qwen-Q4_K_M.gguf").symlink_to(blob)
    touch(home / ".lmstudio" / "models" / "lmstudio-community" / "Llama-GGUF" / "Llama-Q8_0.gguf")
    touch(home / ".cache" / "lm-studio" / "models" / "pub" / "repo" / "Old-Q4.gguf")
    touch(home / ".cache" / "llama.cpp" / "ggml-org_gemma_gemma-Q4.gguf")

    library = ModelLibrary(tmp_path / "library.json",
                           locations=default_locations(environ={}, home=home))
    found = {e.name: e for e in library.scan()}

    assert set(found) == {"Qwen-Q4_K_M", "Llama-Q8_0", "Old-Q4", "ggml-org_gemma_gemma-Q4"}
    assert found["Qwen-Q4_K_M"].source == "huggingface"
    assert found["Qwen-Q4_K_M"].detail == "bartowski/Qwen-GGUF"
    assert found["Qwen-Q4_K_M"].source_label == "Hugging Face"
    assert found["Llama-Q8_0"].source == "lmstudio"
    assert found["Llama-Q8_0"].detail == "lmstudio-community/Llama-GGUF"
    assert found["ggml-org_gemma_gemma-Q4"].source == "llama.cpp"


def test_environment_moves_the_caches(tmp_path: Path) -> None:
    locations = default_locations(
        environ={"HF_HUB_CACHE": str(tmp_path / "hf"), "LLAMA_CACHE": str(tmp_path / "lc")},
        home=tmp_path)
    paths = {loc.source: loc.path for loc in locations}
    assert paths["huggingface"] == tmp_path / "hf"
    assert paths["llama.cpp"] == tmp_path / "lc"
    hf_home = default_locations(environ={"HF_HOME": str(tmp_path / "h")}, home=tmp_path)
    assert hf_home[0].path == tmp_path / "h" / "hub"


def test_projectors_and_later_split_parts_are_not_models(tmp_path: Path) -> None:
    for name in ("model.gguf", "mmproj-model-f16.gguf", "big-00001-of-00003.gguf",
                 "big-00002-of-00003.gguf", "notes.txt", ".hidden.gguf"):
        touch(tmp_path / name)
    assert sorted(p.name for p in find_gguf_files(tmp_path)) == ["big-00001-of-00003.gguf", "model.gguf"]


def test_hidden_folders_and_depth_limit(tmp_path: Path) -> None:
    touch(tmp_path / ".git" / "x.gguf")
    touch(tmp_path / "a" / "b" / "c" / "deep.gguf")
    assert list(find_gguf_files(tmp_path, max_depth=2)) == []
    assert [p.name for p in find_gguf_files(tmp_path)] == ["deep.gguf"]


def test_missing_location_is_fine(tmp_path: Path) -> None:
    assert list(find_gguf_files(tmp_path / "nope")) == []


def test_opened_files_and_folders_are_remembered(tmp_path: Path) -> None:
    model = touch(tmp_path / "elsewhere" / "mine.gguf")
    folder = tmp_path / "models"
    touch(folder / "sub" / "theirs.gguf")
    store = tmp_path / "config" / "library.json"

    library = ModelLibrary(store, locations=[])
    library.add_file(model)
    library.add_folder(folder)
    library.save()

    again = ModelLibrary.load(store, locations=[])
    entries = {e.name: e for e in again.scan()}
    assert entries["mine"].source == "opened"
    assert entries["theirs"].source == "folder"
    assert entries["theirs"].detail == str(folder)

    again.remove_folder(folder)
    again.forget(model)
    assert again.scan() == []


def test_recent_first_then_by_name(tmp_path: Path) -> None:
    for name in ("b", "a", "c", "d"):
        touch(tmp_path / f"{name}.gguf")
    library = ModelLibrary(tmp_path / "library.json", locations=[Location("folder", tmp_path)])
    library.mark_used(tmp_path / "c.gguf", when=100.0)
    library.mark_used(tmp_path / "d.gguf", when=200.0)
    assert [e.name for e in library.scan()] == ["d", "c", "a", "b"]
    assert library.scan()[0].last_used == 200.0


def test_a_model_found_twice_is_listed_once(tmp_path: Path) -> None:
    model = touch(tmp_path / "models" / "m.gguf")
    library = ModelLibrary(tmp_path / "library.json",
                           locations=[Location("folder", tmp_path / "models")])
    library.add_file(model)
    entries = library.scan()
    assert [(e.name, e.source) for e in entries] == [("m", "opened")]


def test_opened_file_that_vanished_is_listed_as_missing(tmp_path: Path) -> None:
    library = ModelLibrary(tmp_path / "library.json", locations=[])
    library.add_file(tmp_path / "gone.gguf")
    [entry] = library.scan()
    assert not entry.exists and entry.size == 0


def test_search_matches_every_word(tmp_path: Path) -> None:
    touch(tmp_path / "Qwen2.5-Coder-7B-Q4_K_M.gguf")
    touch(tmp_path / "Llama-3-8B-Q8_0.gguf")
    entries = ModelLibrary(tmp_path / "l.json", locations=[Location("folder", tmp_path)]).scan()
    assert [e.name for e in search(entries, "coder q4")] == ["Qwen2.5-Coder-7B-Q4_K_M"]
    assert [e.name for e in search(entries, "LLAMA")] == ["Llama-3-8B-Q8_0"]
    assert len(search(entries, "  ")) == 2
    assert search(entries, "mistral") == []


def test_load_settings_per_model_survive_a_restart(tmp_path: Path) -> None:
    store = tmp_path / "library.json"
    library = ModelLibrary(store, locations=[])
    wanted = LoadSettings(ctx_size=4096, parallel="3", n_gpu_layers="12", threads=4,
                          extra_args=("--temp", "0.2"))
    library.remember_settings(tmp_path / "m.gguf", wanted)
    library.save()
    again = ModelLibrary.load(store, locations=[])
    assert again.settings_for(tmp_path / "m.gguf") == wanted
    assert again.settings_for(tmp_path / "other.gguf") == LoadSettings()


def test_unreadable_library_file_gives_an_empty_library(tmp_path: Path) -> None:
    store = tmp_path / "library.json"
    store.write_text("{not json")
    assert ModelLibrary.load(store, locations=[]).opened == []
    store.write_text(json.dumps({"opened": "nope", "recent": {"x": "y"}, "load_settings": []}))
    library = ModelLibrary.load(store, locations=[])
    assert library.opened == [] and library.recent == {}


def test_unreadable_folder_entries_do_not_stop_the_scan(tmp_path: Path) -> None:
    touch(tmp_path / "ok.gguf")
    (tmp_path / "dangling.gguf").symlink_to(tmp_path / "nowhere.gguf")
    entries = ModelLibrary(tmp_path / "l.json", locations=[Location("folder", tmp_path)]).scan()
    assert {e.name: e.exists for e in entries} == {"ok": True, "dangling": False}
    assert os.path.exists(entries[0].path) or os.path.exists(entries[1].path)
