"""What a loaded llama-server says it runs on, read from its own load output.

llama-server prints, while it loads: the devices it uses (`using device Vulkan0 (...) -
N MiB free`), how many layers went to the GPU (`offloaded 5/5 layers to GPU`), the
buffers it allocated on each device (model, KV cache, a hybrid's or recurrent model's
state, compute) and the context it ended
up with (`n_ctx = N`, which `--fit on` may have shrunk), then its slots and how they share
the KV cache (`initializing, n_slots = N, n_ctx_slot = S, kv_unified = 'true'`).
`EngineReportReader` is the one reader of that output: fed every line of one start, it
gives the `EngineReport` and the `KvCapacity` (whose rules live in `backend.llama.kv_capacity`);
`gpu_failure_reason` reads a failed start's lines for the GPU problem behind it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from backend.llama.kv_capacity import KvCapacity, kv_from_load

HOST = "CPU"


@dataclass(frozen=True)
class DeviceUse:
    name: str  # llama.cpp's device name: "Vulkan0", "CUDA0", "MTL0", "ROCm0", "RPC0", or "CPU"
    description: str = ""  # "NVIDIA GeForce RTX 4090", "llvmpipe (LLVM 15.0.6, 256 bits)"
    free_mib: int | None = None  # free when the load began
    model_mib: float = 0.0
    kv_mib: float = 0.0
    compute_mib: float = 0.0
    state_mib: float = 0.0  # recurrent layers' state ("RS buffer")

    @property
    def total_mib(self) -> float:
        return self.model_mib + self.kv_mib + self.compute_mib + self.state_mib


@dataclass(frozen=True)
class EngineReport:
    backend: str  # "cpu", "cuda", "vulkan", "metal", "hip"; "rpc" when the first device is a worker
    devices: tuple[DeviceUse, ...] = ()  # accelerators first, then the host ("CPU")
    layers_offloaded: int | None = None
    layers_total: int | None = None
    context_size: int | None = None  # total over the slots, as the engine chose it
    context_reduced_from: int | None = None  # what --fit shrank it from to fit the memory

    @property
    def gpu_devices(self) -> tuple[DeviceUse, ...]:
        return tuple(d for d in self.devices if d.name != HOST)

    @property
    def on_gpu(self) -> bool:
        return bool(self.layers_offloaded) and bool(self.gpu_devices)

    def summary(self) -> str:
        """One line for people: where the layers are and what memory they took ("the
        CPU; memory: 29 MiB", "vulkan: 3/3 layers on Vulkan0 (...); memory: ...")."""
        if self.on_gpu:
            where = ", ".join(f"{d.name} ({d.description})" if d.description else d.name
                              for d in self.gpu_devices)
            text = f"{self.backend}: {self.layers_offloaded}/{self.layers_total} layers on {where}"
        else:
            text = "the CPU" + (f" (all {self.layers_total} layers)" if self.layers_total else "")
        used = [d for d in self.devices if d.total_mib]
        if [d.name for d in used] == [HOST] and not self.on_gpu:
            text += f"; memory: {used[0].total_mib:.0f} MiB"
        elif used:
            text += "; memory: " + ", ".join(f"{d.name} {d.total_mib:.0f} MiB" for d in used)
        return text

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["devices"] = [dict(asdict(d), total_mib=round(d.total_mib, 2)) for d in self.devices]
        data["summary"] = self.summary()
        return data


class EngineReportReader:
    """Collects one start's output lines; `report()` and `kv_capacity()` after the load."""

    def __init__(self) -> None:
        self._devices: dict[str, dict[str, Any]] = {}
        self._order: list[str] = []
        self._layers: tuple[int, int] | None = None
        self._ctx: int | None = None  # --fit's dry run prints one too; the real load's comes last
        self._reduced_from: int | None = None
        self._slots: int | None = None
        self._per_slot: int | None = None
        self._unified = False
        self._pool_at_least = 0  # from the server's capping messages

    def feed(self, line: str) -> None:
        if "n_ctx" in line or "context (" in line:  # few lines get past these two tests
            if self._feed_context(line):
                return
        if _REAL_LOAD.search(line):
            # Anything before was --fit measuring; the real load's buffers start here.
            for dev in self._devices.values():
                for kind in ("model_mib", "kv_mib", "compute_mib", "state_mib"):
                    dev.pop(kind, None)
            return
        m = _FIT_REDUCED.search(line)
        if m:
            self._reduced_from = int(m.group(1))
            return
        m = _USING_DEVICE.search(line)
        if m:
            dev = self._device(m.group("name"))
            dev["description"] = m.group("desc")
            dev["free_mib"] = int(m.group("free"))
            return
        m = _OFFLOADED.search(line)
        if m:
            self._layers = (int(m.group(1)), int(m.group(2)))
            return
        m = _BUFFER.search(line)
        if m:
            kind = {"model": "model_mib", "KV": "kv_mib", "compute": "compute_mib",
                    "RS": "state_mib"}[m.group("kind")]
            dev = self._device(_owner(m.group("buffer")))
            dev[kind] = dev.get(kind, 0.0) + float(m.group("mib"))
            return

    def report(self) -> EngineReport:
        accelerators = [n for n in self._order if n != HOST]
        devices = tuple(DeviceUse(name=n, **self._devices[n])
                        for n in accelerators + ([HOST] if HOST in self._devices else []))
        backend = _backend_of(accelerators[0]) if accelerators else "cpu"
        offloaded, total = self._layers or (None, None)
        return EngineReport(backend, devices, offloaded, total, self._ctx, self._reduced_from)

    def kv_capacity(self, slots: int | None = None) -> KvCapacity | None:
        """The cache the engine reported, or None when its load line never came."""
        return kv_from_load(slots or self._slots, self._per_slot, self._unified,
                            self._ctx, self._pool_at_least)

    def _feed_context(self, line: str) -> bool:
        m = _INITIALIZING.search(line)
        if m:
            self._slots, self._per_slot = int(m.group(1)), int(m.group(2))
            self._unified = m.group(3) == "true"
            return True
        m = _N_CTX.search(line)
        if m:
            self._ctx = int(m.group(1))
            return True
        m = _CAPPED.search(line)
        if m:
            self._pool_at_least = max(self._pool_at_least, int(m.group(1) or m.group(2)))
            return True
        return False

    def _device(self, name: str) -> dict[str, Any]:
        if name not in self._devices:
            self._devices[name] = {}
            self._order.append(name)
        return self._devices[name]


def gpu_failure_reason(lines: list[str]) -> str | None:
    """A readable sentence when a failed start's output shows a GPU problem, else None."""
    text = "\n".join(lines)
    for pattern, reason in _GPU_FAILURES:
        if re.search(pattern, text, re.I):
            return reason
    return None


# --- helpers --------------------------------------------------------------------------------

_USING_DEVICE = re.compile(
    r"using device (?P<name>\S+) \((?P<desc>.*)\) \(.*\) - (?P<free>\d+) MiB free")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(
    r":\s+(?P<buffer>\S+) (?P<kind>model|KV|compute|RS) buffer size =\s*(?P<mib>[\d.]+) MiB")
_REAL_LOAD = re.compile(r"load_tensors: loading model tensors")
_FIT_REDUCED = re.compile(r"context size reduced from (\d+) to (\d+)")
_N_CTX = re.compile(r"llama_context: n_ctx\s+=\s*(\d+)")
_INITIALIZING = re.compile(
    r"initializing, n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(true|false)'")
# "capping per-slot context (POOL) to --kv-unified-per-slot", and "the slot context (C)
# exceeds the training context of the model" where C is the pool, or the smaller
# per-slot cap: both lower bounds of the pool.
_CAPPED = re.compile(r"capping per-slot context \((\d+)\)|the slot context \((\d+)\) exceeds")

_BACKEND_PREFIXES = (("Vulkan", "vulkan"), ("CUDA", "cuda"), ("ROCm", "hip"), ("HIP", "hip"),
                     ("MTL", "metal"), ("Metal", "metal"), ("RPC", "rpc"))

_GPU_FAILURES = (
    (r"in a buffer \((Vulkan|CUDA|ROCm|MTL|Metal)\w*\) that cannot run",
     "The GPU cannot hold the model's buffers at this size (the context is too large for "
     "the device). Use a smaller context or fewer GPU layers, or load it on the CPU."),
    (r"out of memory|ErrorOutOfDeviceMemory|failed to allocate .*(CUDA|Vulkan|ROCm|Metal|MTL)"
     r"|cudaMalloc failed|unable to allocate .* buffer",
     "The GPU ran out of memory while loading the model. Offload fewer layers, use a smaller "
     "context, or load it on the CPU."),
    (r"CUDA driver version is insufficient|driver/library version mismatch|"
     r"no CUDA-capable device|CUDA error",
     "The CUDA engine could not use the GPU (driver missing or older than the engine "
     "needs). Update the NVIDIA driver, or load the model on the CPU."),
    (r"ErrorInitializationFailed|ErrorIncompatibleDriver|vk::.*Error|ggml_vulkan: .*(error|failed)",
     "The Vulkan driver failed while loading the model. Update the GPU driver, or load the "
     "model on the CPU."),
    (r"hipError|ROCm error|HIP error",
     "The ROCm engine could not use the GPU. Check the ROCm driver, or load the model on the CPU."),
    (r"ggml_metal.*(error|failed)",
     "Metal failed while loading the model. Load it on the CPU instead."),
)


def _owner(buffer: str) -> str:
    """The device a buffer lives on: host buffers (CPU_Mapped, CUDA_Host, ...) are the CPU;
    an RPC worker's buffers carry its address ("RPC0[10.0.0.2:50052]" is RPC0)."""
    if buffer.startswith("CPU") or buffer.endswith("_Host") or buffer.endswith("_Mapped"):
        return HOST
    return buffer.split("[", 1)[0]


def _backend_of(device: str) -> str:
    return next((b for prefix, b in _BACKEND_PREFIXES if device.startswith(prefix)), "cpu")
