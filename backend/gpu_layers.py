"""The GPU-layers setting: "auto", "all", "none" or a number of layers.

"auto" (the default) is llama-server's own: offload what fits in device memory, with
`--fit on` shrinking what the user left unset (the context) to make it fit.  "none" keeps
every layer and the KV cache off the GPU (`--device none`), which is also what the CPU
retry of a failed GPU load uses.  Settings saved before this was a string hold ints.
"""

from __future__ import annotations

from typing import Any

from backend.errors import SettingsError

AUTO, ALL, NONE = "auto", "all", "none"
DEFAULT = AUTO
CHOICES = (AUTO, ALL, NONE)


def parse_gpu_layers(value: Any) -> str:
    """"auto" | "all" | "none" | "<n>"; raises SettingsError for anything else."""
    if isinstance(value, bool):
        raise SettingsError(f"GPU layers must be auto, all, none or a number, not {value!r}.")
    if isinstance(value, int):
        return NONE if value == 0 else str(value) if value > 0 else AUTO
    text = str(value).strip().lower()
    if text in CHOICES:
        return text
    if text in {"", "default"}:
        return DEFAULT
    if text in {"0", "cpu", "off"}:
        return NONE
    if text.lstrip("-").isdigit():
        number = int(text)
        if number == 0:
            return NONE
        if number > 0:
            return str(number)
        if number in (-1, -2):  # llama.cpp's own encodings
            return AUTO if number == -1 else ALL
    raise SettingsError(f"GPU layers must be auto, all, none or a number, not {value!r}.")


def read_saved_gpu_layers(value: Any) -> str:
    """A value from a settings file.  Before GPU engines existed the field was an int and 0
    (then the default, "None (CPU only)") was written by every save, while the engine
    could not offload anyway; reading that 0 as "none" would keep every existing user off
    the GPU for good, so it reads as the new default."""
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return DEFAULT
    try:
        return parse_gpu_layers(value)
    except SettingsError:
        return DEFAULT


def gpu_layer_args(value: str) -> list[str]:
    """llama-server arguments for one GPU-layers value."""
    value = parse_gpu_layers(value)
    if value == NONE:
        return ["--n-gpu-layers", "0", "--device", "none", "--fit", "off"]
    # With --fit on, llama-server fits what the user left unset (the context when it is
    # "model's own", the layers when "auto") into free device memory.
    return ["--n-gpu-layers", value, "--fit", "on"]


def describe(value: str) -> str:
    value = parse_gpu_layers(value)
    return {AUTO: "automatic (what fits)", ALL: "all layers", NONE: "none (CPU only)"}.get(
        value, f"{value} layers")
