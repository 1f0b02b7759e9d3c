"""Will it fit: the memory a model needs at a context size, against this machine's.

Need = the weights (the file sizes: llama.cpp maps them as they are) + the KV cache for
the chosen context + a margin for compute buffers.  The KV cache comes from the GGUF
header when the file is here (layers, KV heads, key and value widths), else roughly from
the parameter count the repository reports.  The machine is a `MachineMemory`: RAM is
read here; GPU memory is what the accelerator detection reports
(`Accelerators.offload_memory`), handed in by the caller: detection runs programs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from backend.errors import ModelFileError
from backend.models.gguf_info import ModelInfo

if TYPE_CHECKING:
    from backend.models.hub import RepoListing

__all__ = [
    "DEFAULT_FIT_CONTEXT",
    "FitEstimate",
    "KvShape",
    "MachineMemory",
    "estimate_fit",
    "fit_choices",
    "format_bytes",
    "machine_memory",
    "total_ram_bytes",
]

DEFAULT_FIT_CONTEXT = 8192
KV_BYTES_PER_VALUE = 2  # llama-server's default cache type is f16
# Without a header: KV bytes per token per parameter, from common grouped-query models
# (Llama 3 8B: 128 KiB a token for 8 B parameters); an estimate, and said to be one.
ROUGH_KV_BYTES_PER_PARAM_TOKEN = 1.6e-5
COMPUTE_MARGIN_BYTES = 256 * 1024 * 1024
COMPUTE_MARGIN_FRACTION = 0.05
GPU_USABLE = 0.95  # drivers and the desktop keep some VRAM
RAM_USABLE = 0.80  # the OS and the other programs keep the rest

FITS_GPU, FITS_RAM, TOO_BIG = "fits in GPU", "fits in RAM", "too big"


@dataclass(frozen=True)
class MachineMemory:
    """What the machine offers; `gpu_vram_bytes` has one entry per GPU (none: CPU only),
    `gpu_names` their names in the same order (when known)."""

    ram_bytes: int
    gpu_vram_bytes: tuple[int, ...] = ()
    gpu_names: tuple[str, ...] = ()

    @property
    def vram_bytes(self) -> int:
        return sum(self.gpu_vram_bytes)


@dataclass(frozen=True)
class KvShape:
    """What the KV cache's size per token depends on."""

    layer_count: int
    head_count_kv: int
    key_length: int
    value_length: int

    @property
    def bytes_per_token(self) -> int:
        return self.layer_count * self.head_count_kv * (self.key_length + self.value_length) * KV_BYTES_PER_VALUE

    @classmethod
    def from_model_info(cls, info: ModelInfo) -> "KvShape | None":
        heads = info.head_count
        if not (info.layer_count and info.embedding_length and heads):
            return None
        head_width = info.embedding_length // heads
        return cls(layer_count=info.layer_count, head_count_kv=info.head_count_kv or heads,
                   key_length=info.key_length or head_width,
                   value_length=info.value_length or head_width)


@dataclass(frozen=True)
class FitEstimate:
    weights_bytes: int
    kv_bytes: int
    margin_bytes: int
    context: int
    basis: str  # "header", "repository" (rough), or "size" (KV cache unknown)
    verdict: str  # FITS_GPU, FITS_RAM or TOO_BIG
    memory: MachineMemory

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.margin_bytes

    def details(self) -> str:
        """The numbers behind the badge, for a tooltip or a second line."""
        if self.basis == "size":
            kv = "context memory unknown until the file is here"
        else:
            about = "about " if self.basis == "repository" else ""
            kv = f"{about}{format_bytes(self.kv_bytes)} for {self.context:,} tokens of context"
        machine = f"this machine: {format_bytes(self.memory.ram_bytes)} RAM"
        if self.memory.gpu_vram_bytes:
            names = self.memory.gpu_names
            machine += ", " + " + ".join(
                format_bytes(v) + (f" ({names[i]})" if i < len(names) else "")
                for i, v in enumerate(self.memory.gpu_vram_bytes)) + " GPU memory"
        return (f"Needs about {format_bytes(self.total_bytes)}: weights {format_bytes(self.weights_bytes)}, "
                f"{kv}, {format_bytes(self.margin_bytes)} working space; {machine}.")


def estimate_fit(weights_bytes: int, memory: MachineMemory, *, context: int = DEFAULT_FIT_CONTEXT,
                 info: ModelInfo | None = None,
                 repo_metadata: Mapping[str, Any] | None = None) -> FitEstimate:
    """The badge for a model of `weights_bytes` at `context` tokens on `memory`."""
    shape = KvShape.from_model_info(info) if info is not None else None
    if info is not None and context <= 0 and info.context_length:
        context = info.context_length
    context = max(context, 1)
    if shape is not None:
        kv, basis = shape.bytes_per_token * context, "header"
    else:
        params = _int((repo_metadata or {}).get("total")) or (info.parameter_count if info else 0)
        if params:
            kv, basis = int(params * ROUGH_KV_BYTES_PER_PARAM_TOKEN * context), "repository"
        else:
            kv, basis = 0, "size"
    margin = COMPUTE_MARGIN_BYTES + int(weights_bytes * COMPUTE_MARGIN_FRACTION)
    need = weights_bytes + kv + margin
    if memory.vram_bytes and need <= memory.vram_bytes * GPU_USABLE:
        verdict = FITS_GPU
    elif need <= memory.ram_bytes * RAM_USABLE:
        verdict = FITS_RAM
    else:
        verdict = TOO_BIG
    return FitEstimate(weights_bytes, kv, margin, context, basis, verdict, memory)


def machine_memory(gpus: Sequence[tuple[str, int]] = ()) -> MachineMemory:
    """This machine's RAM with `gpus` as (name, bytes), e.g. `Accelerators.offload_memory()`."""
    return MachineMemory(total_ram_bytes(), tuple(int(size) for _, size in gpus),
                         tuple(name for name, _ in gpus))


def total_ram_bytes() -> int:
    """Physical memory; 0 when the system does not say."""
    if sys.platform == "win32":
        return _windows_ram()
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def format_bytes(n: int) -> str:
    """Decimal units, as disks and download sizes are usually quoted: 4.7 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _windows_ram() -> int:
    if sys.platform != "win32":  # ctypes.windll exists only there; mypy reads this too
        return 0
    import ctypes

    class MemoryStatus(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

    status = MemoryStatus()
    status.dwLength = ctypes.sizeof(MemoryStatus)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
        return 0
    return int(status.ullTotalPhys)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def fit_choices(listing: RepoListing, memory: MachineMemory, context: int = DEFAULT_FIT_CONTEXT,
                cache_dir: Path | None = None) -> dict[str, FitEstimate]:
    """A badge per model of `listing`, by name; from the header for files already here.

    Reads local headers: call it off the GUI thread.
    """
    from backend.models.gguf_info import read_model_info
    from backend.models.download import snapshot_path

    fits: dict[str, FitEstimate] = {}
    for choice in listing.choices:
        local = snapshot_path(choice, listing.commit, cache_dir)
        info = None
        if local.is_file():
            try:
                info = read_model_info(local)
            except ModelFileError:
                info = None
        fits[choice.name] = estimate_fit(choice.size, memory, context=context, info=info,
                                         repo_metadata=listing.gguf_metadata)
    return fits
