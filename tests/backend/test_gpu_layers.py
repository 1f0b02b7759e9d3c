"""The GPU-layers setting and the llama-server flags each value turns into."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.errors import SettingsError
from backend.gpu_layers import gpu_layer_args, parse_gpu_layers
from backend.llama.load import LoadSettings, LoadSpec
from backend.settings import Settings
from backend.llama.supervisor import build_command


def flags(spec: LoadSpec) -> list[str]:
    return build_command(Path("llama-server"), spec, 1234)


def test_a_default_load_offloads_what_fits_and_lets_fit_choose_the_context():
    args = flags(LoadSettings().to_spec("m.gguf"))
    assert args[args.index("--n-gpu-layers") + 1] == "auto"
    assert args[args.index("--fit") + 1] == "on"
    assert args[args.index("--ctx-size") + 1] == "0"
    # -c 0 alone would forbid --fit to shrink it; the floor after it allows that again.
    assert args[args.index("--ctx-size"):args.index("--ctx-size") + 4] == \
        ["--ctx-size", "0", "--fit-ctx", "4096"]
    assert "--device" not in args


@pytest.mark.parametrize("value, expected", [
    ("all", ["--n-gpu-layers", "all", "--fit", "on"]),
    ("20", ["--n-gpu-layers", "20", "--fit", "on"]),
    (20, ["--n-gpu-layers", "20", "--fit", "on"]),
    ("none", ["--n-gpu-layers", "0", "--device", "none", "--fit", "off"]),
    ("0", ["--n-gpu-layers", "0", "--device", "none", "--fit", "off"]),
])
def test_each_gpu_layers_choice_becomes_its_flags(value, expected):
    args = flags(LoadSettings(n_gpu_layers=value).to_spec("m.gguf"))
    start = args.index("--n-gpu-layers")
    assert args[start:start + len(expected)] == expected
    assert gpu_layer_args(value) == expected


@pytest.mark.parametrize("text", ["some", "1.5", "-7"])
def test_an_unusable_gpu_layers_value_is_refused_with_the_choices(text):
    with pytest.raises(SettingsError, match="auto, all, none or a number"):
        LoadSettings(n_gpu_layers=text)


def test_llama_cpp_encodings_and_spellings_are_understood():
    assert parse_gpu_layers("-1") == "auto"
    assert parse_gpu_layers("-2") == "all"
    assert parse_gpu_layers(" ALL ") == "all"
    assert parse_gpu_layers("") == "auto"


def test_settings_saved_before_gpu_engines_load_with_automatic_offload(tmp_path):
    """Every save used to write n_gpu_layers: 0 (the only choice a CPU engine had), so an
    old 0 means "never chosen"; other old numbers stay numbers."""
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"n_gpu_layers": 0}))
    assert Settings.load(path, environ={}).n_gpu_layers == "auto"
    path.write_text(json.dumps({"n_gpu_layers": 24}))
    assert Settings.load(path, environ={}).n_gpu_layers == "24"
    assert LoadSettings.from_dict({"n_gpu_layers": 0}).n_gpu_layers == "auto"
    assert LoadSettings.from_dict({"n_gpu_layers": 12}).n_gpu_layers == "12"
    assert LoadSettings.from_dict({}).n_gpu_layers == "auto"


def test_none_saved_as_text_stays_none_and_round_trips(tmp_path):
    path = tmp_path / "settings.json"
    Settings(n_gpu_layers="none").save(path, environ={})
    assert Settings.load(path, environ={}).n_gpu_layers == "none"
    assert Settings.load(path, environ={"GGUF_STUDIO_N_GPU_LAYERS": "all"}).n_gpu_layers == "all"
    with pytest.raises(SettingsError):
        Settings().with_overrides({"n_gpu_layers": "lots"})
