"""Which accelerators this machine has, and which engines it can build for them.

Detection only asks the system's own tools and files (nvidia-smi, /proc/driver/nvidia,
rocminfo, /dev/kfd, vulkaninfo, the Vulkan loader's driver manifests, the macOS
platform), never a heavy library.  Every look goes through `Probes`, so the tests can
describe a machine (no GPU, an NVIDIA card without a toolkit, ...) without having one.

Every backend gets a sentence saying why it can or cannot be used, and where a toolkit
is missing, the exact line that installs it on this system.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

BACKENDS = ("cpu", "cuda", "hip", "metal", "vulkan")
# Preference when more than one accelerated engine fits the machine: the vendor's own
# backend first, Vulkan as the portable fallback.
PREFERENCE = ("cuda", "hip", "metal", "vulkan", "cpu")
UNIFIED_GPU_SHARE = 0.75  # of an Apple Silicon Mac's memory, what Metal may wire by default


@dataclass(frozen=True)
class Device:
    backend: str  # the backend that drives it: cuda, hip, vulkan, metal
    name: str
    memory_mib: int | None = None
    kind: str = ""  # "discrete", "integrated", "cpu" (a software device such as lavapipe)


@dataclass(frozen=True)
class Toolkit:
    """What a build for one backend needs beyond a C/C++ compiler."""

    present: bool
    reason: str  # what was found, or what is missing
    install: str = ""  # the line that installs what is missing on this system
    # CMake arguments that point the build at this toolkit; machine paths, not part of
    # the build key (see engine.BuildKey.toolkit for what is).
    cmake_args: tuple[str, ...] = ()
    identity: tuple[str, ...] = ()  # versions that make a build differ, for the key


@dataclass(frozen=True)
class BackendStatus:
    backend: str
    devices: tuple[Device, ...]
    toolkit: Toolkit
    usable: bool  # this machine has something for it to run on
    reason: str  # why it can or cannot be used here

    @property
    def buildable(self) -> bool:
        return self.toolkit.present

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "usable": self.usable, "buildable": self.buildable,
                "reason": self.reason, "devices": [asdict(d) for d in self.devices],
                "toolkit": {"present": self.toolkit.present, "reason": self.toolkit.reason,
                            "install": self.toolkit.install}}


@dataclass(frozen=True)
class Accelerators:
    system: str
    backends: tuple[BackendStatus, ...]

    def get(self, backend: str) -> BackendStatus:
        return next(b for b in self.backends if b.backend == backend)

    def wanted(self) -> list[str]:
        """Backends worth running on this machine, best first; always ends in cpu.  A
        backend whose only devices are software (lavapipe) runs on the CPU anyway, slower
        than the CPU engine, so it is never preferred (build and choose it explicitly)."""
        return [b for b in PREFERENCE if self.get(b).usable and (
            b == "cpu" or any(d.kind != "cpu" for d in self.get(b).devices))]

    def offload_memory(self) -> list[tuple[str, int]]:
        """(device name, bytes of memory a model may fill) for each device llama.cpp offloads
        model layers to here.  Software devices (lavapipe) report the host's RAM as their
        memory and run on the CPU: they are not GPU memory, so they are left out, as are
        devices whose memory is not reported (Vulkan and ROCm listings carry none).  Apple's
        unified memory counts three quarters: what macOS lets the GPU wire by default."""
        found = []
        for backend in self.wanted():
            for d in self.get(backend).devices:
                if d.kind == "cpu" or not d.memory_mib:
                    continue
                share = UNIFIED_GPU_SHARE if backend == "metal" else 1.0
                found.append((d.name, int(d.memory_mib * 1024 * 1024 * share)))
        return found

    def best_buildable(self) -> str:
        """The best backend that has both a device and a toolkit here."""
        return next(b for b in self.wanted() if self.get(b).buildable)

    def to_dict(self) -> dict[str, Any]:
        return {"system": self.system, "best_buildable": self.best_buildable(),
                "backends": [b.to_dict() for b in self.backends]}

    def describe(self) -> list[str]:
        lines = []
        for b in sorted(self.backends, key=lambda s: PREFERENCE.index(s.backend)):
            mark = "yes" if b.usable else "no "
            lines.append(f"  {b.backend:<6} {mark} {b.reason}")
            for d in b.devices:
                mem = f", {d.memory_mib} MiB" if d.memory_mib else ""
                lines.append(f"           device: {d.name}{mem}")
            if b.backend != "cpu" and (b.devices or b.toolkit.present or b.toolkit.install):
                tk = "toolkit ok" if b.toolkit.present else "toolkit missing"
                lines.append(f"           {tk}: {b.toolkit.reason}")
                if b.toolkit.install:
                    lines.append(f"           install: {b.toolkit.install}")
        return lines


@dataclass
class Probes:
    """The machine as detection sees it; the tests pass their own."""

    system: str = field(default_factory=platform.system)  # "Linux", "Darwin", "Windows"
    machine: str = field(default_factory=platform.machine)
    which: Callable[[str], str | None] = shutil.which
    run: Callable[[list[str]], str | None] = field(default_factory=lambda: _run)
    read: Callable[[str], str | None] = field(default_factory=lambda: _read)
    glob: Callable[[str], list[str]] = glob.glob
    exists: Callable[[str], bool] = os.path.exists
    realpath: Callable[[str], str] = os.path.realpath


def detect(probes: Probes | None = None) -> Accelerators:
    p = probes or Probes()
    distro = _distro(p)
    statuses = (
        _cpu(p),
        _cuda(p, distro),
        _hip(p, distro),
        _metal(p),
        _vulkan(p, distro),
    )
    return Accelerators(p.system, statuses)


# --- per backend --------------------------------------------------------------------------


def cpu_claims_amx(cpuinfo: str | None = None) -> bool:
    """Does this CPU say it has Intel AMX (the `amx_int8` flag of /proc/cpuinfo)?
    `cpuinfo`: the file's text, for tests; None reads it (False where there is none)."""
    text = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    for line in (text or "").splitlines():
        if line.startswith("flags"):
            return "amx_int8" in line.split(":", 1)[-1].split()
    return False


def _cpu(p: Probes) -> BackendStatus:
    return BackendStatus("cpu", (), Toolkit(True, "a C/C++ compiler, CMake and Ninja"), True,
                         "always available; every layer on the CPU")


def _cuda(p: Probes, distro: str) -> BackendStatus:
    devices = _nvidia_devices(p)
    driver = p.exists("/proc/driver/nvidia/version") or p.which("nvidia-smi") is not None
    nvcc = p.which("nvcc") or next((c for c in ("/usr/local/cuda/bin/nvcc", "/opt/cuda/bin/nvcc")
                                    if p.exists(c)), None)
    if p.system == "Darwin":
        return BackendStatus("cuda", (), Toolkit(False, "CUDA does not exist on macOS"), False,
                             "not on macOS")
    if nvcc is None:
        toolkit = Toolkit(False, "no nvcc (CUDA toolkit) found", _install_cuda(distro))
    else:
        home = str(Path(p.realpath(nvcc)).parent.parent)
        version = _nvcc_version(p, nvcc)
        blas = any(p.glob(os.path.join(home, pat)) for pat in
                   ("include/cublas_v2.h", "targets/*/include/cublas_v2.h"))
        if not blas:
            toolkit = Toolkit(False, f"nvcc {version} at {nvcc}, but no cuBLAS headers beside it",
                              _install_cublas(distro, version))
        else:
            choices = []
            if not devices:
                # llama.cpp asks the GPU for its architecture ("native"); with none to ask,
                # build the portable set llama.cpp itself uses when not native.
                choices.append(f"-DCMAKE_CUDA_ARCHITECTURES={PORTABLE_CUDA_ARCHITECTURES}")
            if not any(p.glob(pat) for pat in _LIBCUDA):
                # No driver library to link (no driver installed): build without llama.cpp's
                # virtual-memory pool, the one part that links libcuda directly.
                choices.append("-DGGML_CUDA_NO_VMM=ON")
            toolkit = Toolkit(True, f"nvcc {version} at {nvcc} with cuBLAS",
                              cmake_args=(f"-DCMAKE_CUDA_COMPILER={nvcc}",
                                          f"-DCUDAToolkit_ROOT={home}", *choices),
                              identity=(f"nvcc={version}", *choices))
    if devices:
        reason = f"{len(devices)} NVIDIA GPU(s) with a working driver"
    elif driver:
        reason = "an NVIDIA driver is loaded but reported no GPU"
    else:
        reason = "no NVIDIA GPU or driver found"
    return BackendStatus("cuda", devices, toolkit, bool(devices), reason)


def _hip(p: Probes, distro: str) -> BackendStatus:
    if p.system != "Linux":
        return BackendStatus("hip", (), Toolkit(False, "GGUF Studio builds ROCm engines on Linux only"),
                             False, "ROCm is Linux-only here")
    devices = _rocm_devices(p) if p.exists("/dev/kfd") else ()
    hipcc = p.which("hipcc") or ("/opt/rocm/bin/hipcc" if p.exists("/opt/rocm/bin/hipcc") else None)
    if hipcc is None:
        toolkit = Toolkit(False, "no hipcc (ROCm/HIP) found", _install_rocm(distro))
    else:
        root = str(Path(p.realpath(hipcc)).parent.parent)
        toolkit = Toolkit(True, f"hipcc at {hipcc}",
                          cmake_args=(f"-DCMAKE_HIP_COMPILER_ROCM_ROOT={root}",),
                          identity=("hip",))
    if devices:
        reason = f"{len(devices)} AMD GPU(s) through ROCm"
    elif p.exists("/dev/kfd"):
        reason = "the ROCm kernel driver is loaded but no GPU was listed (install rocminfo to list them)"
    else:
        reason = "no AMD ROCm driver (/dev/kfd) found"
    return BackendStatus("hip", devices, toolkit, bool(devices), reason)


def _metal(p: Probes) -> BackendStatus:
    if p.system != "Darwin":
        return BackendStatus("metal", (), Toolkit(False, "Metal exists only on macOS"), False,
                             "not on macOS")
    apple_silicon = p.machine == "arm64"
    memory = None
    out = p.run(["sysctl", "-n", "hw.memsize"])
    if out and out.strip().isdigit():
        memory = int(out.strip()) // (1024 * 1024)
    devices = (Device("metal", "Apple GPU (unified memory)", memory,
                      "integrated"),) if apple_silicon else ()
    # llama.cpp embeds its Metal shaders, so the Command Line Tools' compiler is enough.
    toolkit = Toolkit(True, "Metal framework of macOS (shaders embedded; no extra toolkit)",
                      identity=("metal",))
    reason = ("Apple Silicon: the GPU shares the machine's memory" if apple_silicon
              else "an Intel Mac: Metal offload is slower than the CPU here, not used")
    return BackendStatus("metal", devices, toolkit, apple_silicon, reason)


def _vulkan(p: Probes, distro: str) -> BackendStatus:
    if p.system == "Darwin":
        return BackendStatus("vulkan", (), Toolkit(False, "use Metal on macOS"), False,
                             "Metal is the GPU backend on macOS")
    devices, how = _vulkan_devices(p)
    toolkit = _vulkan_toolkit(p, distro)
    if devices:
        only_software = all(d.kind == "cpu" for d in devices)
        reason = f"{len(devices)} Vulkan device(s) {how}"
        if only_software:
            reason += (" (software only: it runs on the CPU, so the CPU engine is preferred; "
                       "llama.cpp uses it only when GGML_VK_VISIBLE_DEVICES selects it)")
    else:
        reason = how
    return BackendStatus("vulkan", devices, toolkit, bool(devices), reason)


PORTABLE_CUDA_ARCHITECTURES = "75-virtual;80-virtual;86-real;89-real;90-virtual"
_LIBCUDA = ("/usr/lib/*/libcuda.so", "/usr/lib64/libcuda.so", "/usr/local/cuda/lib64/stubs/libcuda.so",
            "/usr/local/cuda/targets/*/lib/stubs/libcuda.so")


# --- devices ---------------------------------------------------------------------------------


def _nvidia_devices(p: Probes) -> tuple[Device, ...]:
    out = p.run(["nvidia-smi", "--query-gpu=name,memory.total",
                 "--format=csv,noheader,nounits"]) if p.which("nvidia-smi") else None
    devices = []
    for line in (out or "").splitlines():
        name, _, mem = line.rpartition(",")
        if name.strip():
            devices.append(Device("cuda", name.strip(),
                                  int(mem.strip()) if mem.strip().isdigit() else None, "discrete"))
    if devices:
        return tuple(devices)
    # nvidia-smi missing or broken: the driver still lists its GPUs under /proc.
    for info in sorted(p.glob("/proc/driver/nvidia/gpus/*/information")):
        m = re.search(r"^Model:\s*(.+)$", p.read(info) or "", re.M)
        if m:
            devices.append(Device("cuda", m.group(1).strip(), None, "discrete"))
    return tuple(devices)


def _rocm_devices(p: Probes) -> tuple[Device, ...]:
    out = p.run(["rocminfo"]) if p.which("rocminfo") or p.exists("/opt/rocm/bin/rocminfo") else None
    devices = []
    for agent in (out or "").split("*******")[1:]:
        if re.search(r"Device Type:\s*GPU", agent):
            m = re.search(r"Marketing Name:\s*(.+)", agent)
            devices.append(Device("hip", m.group(1).strip() if m else "AMD GPU", None, "discrete"))
    return tuple(devices)


_VULKAN_TYPES = {"PHYSICAL_DEVICE_TYPE_DISCRETE_GPU": "discrete",
                 "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU": "integrated",
                 "PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU": "virtual",
                 "PHYSICAL_DEVICE_TYPE_CPU": "cpu"}


def _vulkan_devices(p: Probes) -> tuple[tuple[Device, ...], str]:
    loader = any(p.glob(pat) for pat in ("/usr/lib/*/libvulkan.so.1", "/usr/lib/libvulkan.so.1",
                                         "/usr/lib64/libvulkan.so.1",
                                         "C:/Windows/System32/vulkan-1.dll"))
    manifests = [f for d in ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d")
                 for f in p.glob(f"{d}/*.json")]
    if p.which("vulkaninfo"):
        out = p.run(["vulkaninfo", "--summary"])
        if out is not None:
            devices = []
            for block in re.split(r"\nGPU\d+:", out)[1:]:
                name = re.search(r"deviceName\s*=\s*(.+)", block)
                kind = re.search(r"deviceType\s*=\s*(\S+)", block)
                if name:
                    devices.append(Device("vulkan", name.group(1).strip(), None,
                                          _VULKAN_TYPES.get(kind.group(1) if kind else "", "")))
            if devices:
                return tuple(devices), "listed by vulkaninfo"
            return (), "vulkaninfo lists no Vulkan device"
    if not loader:
        return (), "no Vulkan loader (libvulkan) found"
    if not manifests:
        return (), "the Vulkan loader is present but no driver (ICD) is installed"
    # Without vulkaninfo we cannot ask the loader cheaply; the installed drivers say
    # what it will find.
    names = [Path(m).stem for m in manifests]
    return tuple(Device("vulkan", f"driver {n}", None, "cpu" if "lvp" in n else "")
                 for n in names), "from the installed Vulkan drivers (install vulkan-tools to list devices)"


# --- toolkits --------------------------------------------------------------------------------

# The pinned llama.cpp uses vk::LayerSettingEXT, which older vulkan.hpp lack.
_VULKAN_HPP_NEEDS = "struct LayerSettingEXT"


def vulkan_headers_usable(include_dir: str, p: Probes | None = None) -> bool:
    p = p or Probes()
    text = p.read(os.path.join(include_dir, "vulkan", "vulkan_structs.hpp")) or ""
    return _VULKAN_HPP_NEEDS in text


def vulkan_header_version(include_dir: str, p: Probes | None = None) -> str | None:
    p = p or Probes()
    text = p.read(os.path.join(include_dir, "vulkan", "vulkan_core.h")) or ""
    complete = re.search(r"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(0, (\d+), (\d+), VK_HEADER_VERSION\)", text)
    patch = re.search(r"#define VK_HEADER_VERSION (\d+)", text)
    if complete and patch:
        return f"{complete.group(1)}.{complete.group(2)}.{patch.group(1)}"
    return None


def _vulkan_toolkit(p: Probes, distro: str) -> Toolkit:
    missing, install = [], []
    glslc = p.which("glslc")
    if not glslc:
        missing.append("glslc")
        install.append("glslc")
    if not p.exists("/usr/include/spirv/unified1/spirv.hpp") and not p.glob(
            "/usr/share/cmake/SPIRV-Headers*/*.cmake") and p.system == "Linux":
        missing.append("SPIR-V headers")
        install.append("spirv-headers")
    if not p.glob("/usr/lib/*/libvulkan.so") and not p.exists("/usr/lib/libvulkan.so"):
        missing.append("the Vulkan loader's development files")
        install.append("libvulkan-dev")
    system_headers = "/usr/include"
    version = vulkan_header_version(system_headers, p)
    if version is None:
        if "libvulkan-dev" not in install:
            install.append("libvulkan-dev")
        missing.append("Vulkan headers")
    if missing:
        line = _apt(distro, install) if distro else (
            "install the Vulkan SDK (headers, loader, glslc and SPIR-V headers)")
        return Toolkit(False, "missing " + ", ".join(missing), line)
    identity = (f"glslc={Path(glslc or 'glslc').name}",)
    if vulkan_headers_usable(system_headers, p):
        return Toolkit(True, f"Vulkan headers {version}, glslc and SPIR-V headers",
                       identity=(f"vulkan-headers={version}", *identity))
    # Too old for the pinned llama.cpp (Debian 12 ships 1.3.239): the build fetches
    # newer header-only packages from the distribution's own archive (vulkan_headers.py).
    if distro.startswith("debian") or distro.startswith("ubuntu"):
        return Toolkit(True, f"system Vulkan headers {version} are too old; the build fetches "
                             "newer ones from the Debian archive (header-only, unpacked in the cache)",
                       identity=identity)
    return Toolkit(False, f"Vulkan headers {version} are too old (vk::LayerSettingEXT is missing)",
                   "install Vulkan headers 1.3.275 or newer (the Vulkan SDK)")


def _install_cuda(distro: str) -> str:
    if distro:
        return ("pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cublas "
                f"(or {_apt(distro, ['nvidia-cuda-toolkit'])}, from the non-free/multiverse component)")
    return "install the CUDA toolkit (nvcc and cuBLAS), e.g. pip install nvidia-cuda-nvcc nvidia-cublas"


def _install_cublas(distro: str, version: str) -> str:
    major = version.split(".")[0] if version and version[0].isdigit() else ""
    if not major:
        return "pip install nvidia-cublas, then copy its include/ and lib/ into the CUDA root"
    # The wheel's files sit under nvidia/cu<major>/ and have only versioned .so names.
    return (f"pip install 'nvidia-cublas=={major}.*', then copy its nvidia/cu{major}/include "
            f"and nvidia/cu{major}/lib into the CUDA root beside nvcc and link libcublas.so and "
            f"libcublasLt.so to their .so.{major} files")


def _install_rocm(distro: str) -> str:
    if distro.startswith("debian:13") or distro.startswith("ubuntu:24") or distro.startswith("debian:sid"):
        return _apt(distro, ["hipcc", "libhipblas-dev", "librocblas-dev"])
    return "install ROCm 6 (hipcc, hipBLAS, rocBLAS) with AMD's installer for your distribution"


def _apt(distro: str, packages: list[str]) -> str:
    if distro.startswith(("fedora", "rhel", "centos", "rocky", "almalinux")):
        return "sudo dnf install " + " ".join(packages)
    if distro.startswith("arch"):
        return "sudo pacman -S " + " ".join(packages)
    return "sudo apt-get install " + " ".join(packages)


def _nvcc_version(p: Probes, nvcc: str) -> str:
    out = p.run([nvcc, "--version"]) or ""
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def _distro(p: Probes) -> str:
    """"debian:12", "ubuntu:24.04", ... from /etc/os-release; "" when not Linux or unknown."""
    if p.system != "Linux":
        return ""
    text = p.read("/etc/os-release") or ""
    fields = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', text, re.M))
    ident = fields.get("ID", "")
    return f"{ident}:{fields.get('VERSION_ID', '')}" if ident else ""


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None
