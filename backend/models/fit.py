"""Will it fit: the memory a model needs at a context size, against this machine's.

Need = the weights (the file sizes: llama.cpp maps them as they are) + the context's
memory + a margin for compute buffers.  The context's memory comes from the GGUF header
when the file is here (`backend.models.memory_layout`: which layers keep the whole
context, which a sliding window, which a recurrent state), sized as the pinned llama.cpp
allocates it for the flags the engine is started with (`CacheSettings`: context, slots,
unified or split cache, --swa-full, micro-batch, cache types; `context_memory`); else
roughly from the parameter count the repository reports.  The machine is a
`MachineMemory`: RAM is read here; GPU memory is what the accelerator detection reports
(`Accelerators.offload_memory`), handed in by the caller: detection runs programs.

llama.cpp's rules (src/llama-context.cpp, llama-kv-cache.cpp, llama-kv-cache-iswa.cpp,
llama-memory-recurrent.cpp): the context is padded to 256 cells; a split cache gives
each slot its own stream of context / slots cells (padded to 256), a unified one a single
stream.  A layer that keeps the whole context holds key and value rows for every cell of
every stream.  A sliding-window layer's cache holds min(cells per stream, window x (slots
when unified, else 1) + micro-batch) cells per stream, padded to 256, unless the engine
runs with --swa-full (then as many as a full layer).  A recurrent layer holds one f32
state per slot, whatever the context.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from backend.memory_size import format_memory
from backend.errors import ModelFileError
from backend.gpu_layers import NONE
from backend.llama.engine_speed import DEFAULT_BATCH, DEFAULT_UBATCH
from backend.llama.kv_capacity import LlamaArgs, planned_capacity
from backend.llama.load import LoadSettings
from backend.llama.supervisor import CHECKPOINT_FLAGS, CONTEXT_CHECKPOINTS
from backend.models.gguf_info import ModelInfo
from backend.models.memory_layout import MemoryLayout

if TYPE_CHECKING:
    from backend.models.hub import RepoListing

__all__ = [
    "DEFAULT_FIT_CONTEXT",
    "CacheSettings",
    "ContextMemory",
    "FitEstimate",
    "KvShape",
    "MachineMemory",
    "context_memory",
    "estimate_fit",
    "load_memory",
    "fit_choices",
    "format_bytes",
    "machine_memory",
    "total_ram_bytes",
]

DEFAULT_FIT_CONTEXT = 8192
DEFAULT_CACHE_TYPE = "f16"  # llama-server's, for keys and values
RECURRENT_BYTES_PER_VALUE = 4  # llama.cpp keeps recurrent state in f32
CELL_PADDING = 256  # llama.cpp pads the context and the sliding-window cache to this
#: Context checkpoints a slot keeps in an engine the app starts (--ctx-checkpoints).
DEFAULT_CHECKPOINTS = CONTEXT_CHECKPOINTS
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
class CacheSettings:
    """The engine flags a model's context memory depends on, as llama-server reads them
    (its defaults unless said)."""

    context: int = DEFAULT_FIT_CONTEXT  #: cells of every slot together (-c)
    slots: int = 1  #: sequences the engine serves at once (-np)
    unified: bool = False  #: one stream for all slots (--kv-unified, or -np auto)
    swa_full: bool = False  #: sliding-window layers keep the whole context (--swa-full)
    ubatch: int = DEFAULT_UBATCH  #: the micro-batch (-ub), which a sliding cache adds to its window
    type_k: str = DEFAULT_CACHE_TYPE  #: -ctk
    type_v: str = DEFAULT_CACHE_TYPE  #: -ctv
    #: Flash attention (the engine's `auto` turns it on where the device has it: the CPU
    #: and the GPU backends); without it, values of layers of different widths are padded
    #: to the widest.
    flash_attention: bool = True
    #: Context checkpoints a slot may keep (-ctxcp): copies of what a sliding or recurrent
    #: layer cannot roll back, made as prompts are computed, in RAM beside the cache.
    checkpoints: int = DEFAULT_CHECKPOINTS

    @classmethod
    def of_load(cls, ctx_size: int, parallel: str, trained: int | None,
                extra_args: tuple[str, ...] | list[str] = (), *, fit: bool = True) -> CacheSettings | None:
        """The settings of an engine the app starts with these load settings (`fit`: GPU
        layers other than "none"); None when the context depends on an unknown trained
        context.  With `--fit` and the model's own context, the most it may take."""
        try:
            plan = planned_capacity(ctx_size, str(parallel), trained, tuple(extra_args), fit=fit)
        except ValueError:
            return None
        if plan is None:
            return None
        args = LlamaArgs(tuple(extra_args))
        batch = min(plan.cells, args.number(("-b", "--batch-size")) or DEFAULT_BATCH)
        ubatch = min(batch, args.number(("-ub", "--ubatch-size")) or DEFAULT_UBATCH)
        attention = (args.last(("-fa", "--flash-attn")) or "auto").lower()
        checkpoints = args.number(CHECKPOINT_FLAGS)
        return cls(context=plan.cells, slots=plan.slots, unified=plan.kv.unified,
                   swa_full=args.switch(("--swa-full",), ()), ubatch=max(1, ubatch),
                   type_k=args.last(("-ctk", "--cache-type-k")) or DEFAULT_CACHE_TYPE,
                   type_v=args.last(("-ctv", "--cache-type-v")) or DEFAULT_CACHE_TYPE,
                   flash_attention=attention not in ("off", "0", "false", "disabled"),
                   checkpoints=DEFAULT_CHECKPOINTS if checkpoints is None else max(0, checkpoints))


@dataclass(frozen=True)
class ContextMemory:
    """A model's KV cache and recurrent state at some `CacheSettings`, as llama.cpp
    allocates them when the engine starts."""

    full_bytes: int  #: the layers that keep the whole context
    sliding_bytes: int  #: the sliding-window layers
    recurrent_bytes: int  #: the recurrent layers' state
    full_cells: int  #: cells of a full layer, every stream's together
    sliding_cells: int  #: cells of a sliding layer, every stream's together
    layout: MemoryLayout
    settings: CacheSettings
    #: The most the slots' context checkpoints may take as sessions go on: each a copy of
    #: a slot's sliding window and state.  Not allocated at the start, nor counted in
    #: `total_bytes`: it grows with use, in RAM, up to this.
    checkpoint_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.sliding_bytes + self.recurrent_bytes

    @property
    def bytes_per_token(self) -> int:
        """What one more token of context costs (the full layers' key and value rows)."""
        return self.full_bytes // self.full_cells if self.full_cells else 0

    @property
    def bytes_per_sequence(self) -> int:
        """What one more slot costs whatever the context: its sliding window and state."""
        slots = max(1, self.settings.slots)
        return (self.sliding_bytes + self.recurrent_bytes) // slots

    def describe(self) -> str:
        """For people: "116 MB: 101 MB for 32,768 tokens in 3 layers, 15.7 MB for 15
        sliding-window layers (512 tokens; 1,024 cells)"; the checkpoints' bound after."""
        text = f"{format_bytes(self.total_bytes)}: {self.breakdown()}"
        if self.checkpoint_bytes:
            text += (f"; context checkpoints may add up to {format_bytes(self.checkpoint_bytes)} "
                     f"as sessions go on ({self.settings.checkpoints} a slot)")
        return text

    def breakdown(self) -> str:
        """Where the bytes go, by kind of layer."""
        layout, slots = self.layout, max(1, self.settings.slots)
        streams = 1 if self.settings.unified else slots
        parts = []
        if layout.full_layers:
            parts.append(f"{format_bytes(self.full_bytes)} for {self.full_cells:,} tokens in "
                         f"{_layers(layout.full_layers)}")
        if layout.sliding_layers:
            a_slot = " a slot" if streams > 1 else ""
            parts.append(f"{format_bytes(self.sliding_bytes)} for {layout.sliding_layers} "
                         f"sliding-window layer{'s' if layout.sliding_layers != 1 else ''} "
                         f"({layout.sliding_window:,} tokens; {self.sliding_cells // streams:,} "
                         f"cells{a_slot})")
        if layout.recurrent_layers:
            a_slot = f", {format_bytes(self.recurrent_bytes // slots)} a slot" if slots > 1 else ""
            parts.append(f"{format_bytes(self.recurrent_bytes)} of recurrent state in "
                         f"{_layers(layout.recurrent_layers)}{a_slot}")
        return ", ".join(parts) or "nothing"


def context_memory(layout: MemoryLayout, settings: CacheSettings) -> ContextMemory:
    """The KV cache and recurrent state llama.cpp allocates for `layout` at `settings`."""
    slots = max(1, settings.slots)
    streams = 1 if settings.unified else slots
    n_ctx = _pad(max(1, settings.context))
    per_stream = n_ctx if settings.unified else _pad(n_ctx // slots)
    if settings.swa_full:
        sliding_per_stream = per_stream
    else:
        window = layout.sliding_window * (slots if settings.unified else 1)
        sliding_per_stream = _pad(min(per_stream, window + settings.ubatch))
    widest_value = max((layer.value_width for layer in layout.kv_layers), default=0)
    padded_values = not settings.flash_attention and any(
        layer.value_width != widest_value for layer in layout.kv_layers)

    def row_bytes(sliding: bool) -> int:
        layers = [layer for layer in layout.kv_layers if layer.sliding == sliding]
        keys = sum(layer.key_width for layer in layers)
        values = sum(widest_value if padded_values and layer.value_width else layer.value_width
                     for layer in layers)
        return _bytes(settings.type_k, keys) + _bytes(settings.type_v, values)

    full_cells, sliding_cells = per_stream * streams, sliding_per_stream * streams
    state_per_slot = layout.recurrent_state_values * RECURRENT_BYTES_PER_VALUE
    # A checkpoint holds the cells one slot's sliding layers still use (its window: the
    # micro-batch beside it is free again between batches; measured, Gemma 3 270M: 7.5
    # MiB, 512 cells of 15 layers) and its state; llama-server makes them only for
    # models that need them.
    window_per_slot = 0 if settings.swa_full or not layout.sliding_layers else \
        min(per_stream, layout.sliding_window)
    checkpoint = window_per_slot * row_bytes(True) + state_per_slot
    return ContextMemory(
        full_bytes=row_bytes(False) * full_cells,
        sliding_bytes=row_bytes(True) * sliding_cells,
        recurrent_bytes=state_per_slot * slots,
        full_cells=full_cells,
        sliding_cells=sliding_cells if layout.sliding_layers else 0,
        layout=layout, settings=settings,
        checkpoint_bytes=checkpoint * settings.checkpoints * slots)


@dataclass(frozen=True)
class KvShape:
    """What a slot's cache holds of a model, from its header, at f16 (the engine's default
    cache type): `bytes_per_token` for each token of its prompt (the layers that keep the
    whole context) and `bytes_per_sequence` whatever its length (its sliding window and a
    micro-batch, its recurrent state)."""

    bytes_per_token: int
    bytes_per_sequence: int = 0

    @classmethod
    def from_model_info(cls, info: ModelInfo) -> KvShape | None:
        if info.memory is None:
            return None
        # A context long enough for the whole window and a micro-batch.
        context = _pad(info.memory.sliding_window + DEFAULT_UBATCH)
        one_slot = context_memory(info.memory, CacheSettings(context=context))
        return cls(one_slot.bytes_per_token, one_slot.bytes_per_sequence)


def load_memory(info: ModelInfo, settings: LoadSettings) -> ContextMemory | None:
    """The context memory of the model `info` describes loaded with `settings` (None when
    its header does not say, or its context depends on what it does not say)."""
    cache = CacheSettings.of_load(settings.ctx_size, str(settings.parallel), info.context_length,
                                  settings.extra_args, fit=settings.n_gpu_layers != NONE)
    if info.memory is None or cache is None:
        return None
    return context_memory(info.memory, cache)


@dataclass(frozen=True)
class FitEstimate:
    weights_bytes: int
    kv_bytes: int
    margin_bytes: int
    context: int
    basis: str  # "header", "repository" (rough), or "size" (KV cache unknown)
    verdict: str  # FITS_GPU, FITS_RAM or TOO_BIG
    memory: MachineMemory
    #: The KV cache and state by kind, when the header told (basis "header").
    context_memory: ContextMemory | None = None

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
            if self.context_memory is not None and (self.context_memory.layout.sliding_layers
                                                    or self.context_memory.layout.recurrent_layers):
                kv += f" ({self.context_memory.breakdown()})"
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
                 repo_metadata: Mapping[str, Any] | None = None,
                 cache: CacheSettings | None = None) -> FitEstimate:
    """The badge for a model of `weights_bytes` at `context` tokens on `memory`; `cache`:
    how the engine would be started (default: one slot of `context` tokens, the engine's
    defaults otherwise), which then gives the context."""
    layout = info.memory if info is not None else None
    if cache is not None:
        context = cache.context
    elif info is not None and context <= 0 and info.context_length:
        context = info.context_length
    context = max(context, 1)
    sized = None
    if layout is not None:
        sized = context_memory(layout, cache or CacheSettings(context=context))
        kv, basis = sized.total_bytes, "header"
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
    return FitEstimate(weights_bytes, kv, margin, context, basis, verdict, memory, sized)


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
    """Memory in the one unit family the window uses everywhere (`backend.memory_size`):
    "111 MiB", "3.7 GiB"."""
    return format_memory(n)


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


def _pad(cells: int) -> int:
    return -(-cells // CELL_PADDING) * CELL_PADDING


def _bytes(cache_type: str, values: int) -> int:
    """The bytes of `values` elements of a cache type (f16, q8_0, ...); an unknown one as f16."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[cache_type.upper()]]
    except KeyError:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType.F16]
    return values * size // block


def _layers(n: int) -> str:
    return f"{n} layer{'s' if n != 1 else ''}"


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
