"""Accelerator detection, on machines described by fake probes (no GPU needed)."""

from __future__ import annotations

import fnmatch

import pytest

from backend.llama.accelerators import Probes, detect

DEBIAN_12 = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n'
OLD_VULKAN_CORE = ("#define VK_HEADER_VERSION 239\n#define VK_HEADER_VERSION_COMPLETE "
                   "VK_MAKE_API_VERSION(0, 1, 3, VK_HEADER_VERSION)\n")
NEW_VULKAN_CORE = OLD_VULKAN_CORE.replace("239", "309").replace("1, 3,", "1, 4,")

NVIDIA_SMI = "NVIDIA GeForce RTX 4070, 12282\n"
VULKANINFO_DISCRETE = """\
Devices:
========
GPU0:
	apiVersion         = 1.3.255
	deviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
	deviceName         = AMD Radeon RX 7600 (RADV NAVI33)
GPU1:
	apiVersion         = 1.3.255
	deviceType         = PHYSICAL_DEVICE_TYPE_CPU
	deviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
"""
VULKANINFO_LAVAPIPE = """\
Devices:
========
GPU0:
	deviceType         = PHYSICAL_DEVICE_TYPE_CPU
	deviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
"""


def machine(*, system="Linux", arch="x86_64", tools=(), files=None, outputs=None) -> Probes:
    """A machine with these programs on PATH, these files (path -> text), and these
    command outputs (first word of the command -> stdout)."""
    files = {"/etc/os-release": DEBIAN_12, **(files or {})} if system == "Linux" else dict(files or {})
    outputs = outputs or {}
    on_path = {t: f"/usr/bin/{t}" for t in tools}

    def run(cmd):
        name = cmd[0].rsplit("/", 1)[-1]
        return outputs.get(name)

    return Probes(system=system, machine=arch, which=on_path.get, run=run, read=files.get,
                  glob=lambda pattern: sorted(p for p in files if fnmatch.fnmatch(p, pattern)),
                  exists=lambda path: path in files, realpath=lambda path: path)


def vulkan_dev_files(core=NEW_VULKAN_CORE, structs="struct LayerSettingEXT {};"):
    return {"/usr/include/vulkan/vulkan_core.h": core,
            "/usr/include/vulkan/vulkan_structs.hpp": structs,
            "/usr/include/spirv/unified1/spirv.hpp": "",
            "/usr/lib/x86_64-linux-gnu/libvulkan.so": "",
            "/usr/lib/x86_64-linux-gnu/libvulkan.so.1": ""}


def test_a_machine_without_gpu_builds_and_runs_the_cpu_engine():
    found = detect(machine())
    assert found.wanted() == ["cpu"]
    assert found.best_buildable() == "cpu"
    for backend in ("cuda", "hip", "vulkan", "metal"):
        assert not found.get(backend).usable
    assert "no NVIDIA GPU" in found.get("cuda").reason
    assert "no Vulkan loader" in found.get("vulkan").reason


def test_an_nvidia_gpu_without_toolkit_is_found_and_says_what_to_install():
    found = detect(machine(tools=["nvidia-smi"], outputs={"nvidia-smi": NVIDIA_SMI},
                           files={"/proc/driver/nvidia/version": "NVRM 550"}))
    cuda = found.get("cuda")
    assert cuda.usable and not cuda.buildable
    assert cuda.devices[0].name == "NVIDIA GeForce RTX 4070"
    assert cuda.devices[0].memory_mib == 12282
    assert "no nvcc" in cuda.toolkit.reason
    assert "pip install nvidia-cuda-nvcc" in cuda.toolkit.install
    assert "sudo apt-get install nvidia-cuda-toolkit" in cuda.toolkit.install
    # Wanted, but not buildable: the best engine this machine can build is still the CPU's.
    assert found.wanted() == ["cuda", "cpu"]
    assert found.best_buildable() == "cpu"


def test_an_nvidia_gpu_with_nvcc_and_cublas_builds_the_cuda_engine():
    files = {"/proc/driver/nvidia/version": "NVRM 550", "/usr/lib/x86_64-linux-gnu/libcuda.so": "",
             "/usr/local/cuda/bin/nvcc": "", "/usr/local/cuda/include/cublas_v2.h": ""}
    probes = machine(tools=["nvidia-smi"], files=files,
                     outputs={"nvidia-smi": NVIDIA_SMI,
                              "nvcc": "Cuda compilation tools, release 12.4, V12.4.131"})
    found = detect(probes)
    cuda = found.get("cuda")
    assert cuda.buildable, cuda.toolkit.reason
    assert "nvcc 12.4" in cuda.toolkit.reason
    assert "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc" in cuda.toolkit.cmake_args
    assert cuda.toolkit.identity == ("nvcc=12.4",)
    assert found.best_buildable() == "cuda"


def test_a_cuda_build_without_gpu_or_driver_picks_portable_architectures_and_no_vmm():
    """How the CUDA engine configures on this machine: nvcc and cuBLAS from PyPI wheels,
    no GPU to ask for its architecture, no driver library to link."""
    files = {"/usr/local/cuda/bin/nvcc": "", "/usr/local/cuda/include/cublas_v2.h": ""}
    cuda = detect(machine(files=files, outputs={
        "nvcc": "Cuda compilation tools, release 13.0, V13.0.88"})).get("cuda")
    assert cuda.buildable and not cuda.usable
    assert "-DGGML_CUDA_NO_VMM=ON" in cuda.toolkit.cmake_args
    assert any(a.startswith("-DCMAKE_CUDA_ARCHITECTURES=75-virtual") for a in cuda.toolkit.cmake_args)
    assert "-DGGML_CUDA_NO_VMM=ON" in cuda.toolkit.identity  # a different engine, a different key


def test_nvcc_without_cublas_names_the_cublas_wheel_of_its_major_version():
    files = {"/usr/local/cuda/bin/nvcc": ""}
    found = detect(machine(files=files, outputs={
        "nvcc": "Cuda compilation tools, release 13.0, V13.0.88"}))
    assert not found.get("cuda").buildable
    assert "no cuBLAS headers" in found.get("cuda").toolkit.reason
    assert "pip install 'nvidia-cublas==13.*'" in found.get("cuda").toolkit.install


def test_nvidia_gpus_are_listed_from_the_driver_when_nvidia_smi_is_missing():
    files = {"/proc/driver/nvidia/version": "NVRM 550",
             "/proc/driver/nvidia/gpus/0000:01:00.0/information": "Model: \t NVIDIA A100-SXM4-40GB\nIRQ: 1\n"}
    cuda = detect(machine(files=files)).get("cuda")
    assert [d.name for d in cuda.devices] == ["NVIDIA A100-SXM4-40GB"]


def test_a_vulkan_only_machine_prefers_the_vulkan_engine_and_can_build_it():
    found = detect(machine(tools=["vulkaninfo", "glslc"], files=vulkan_dev_files(),
                           outputs={"vulkaninfo": VULKANINFO_DISCRETE}))
    vulkan = found.get("vulkan")
    assert [d.name for d in vulkan.devices] == ["AMD Radeon RX 7600 (RADV NAVI33)",
                                                 "llvmpipe (LLVM 15.0.6, 256 bits)"]
    assert vulkan.devices[0].kind == "discrete"
    assert vulkan.buildable, vulkan.toolkit.reason
    assert "Vulkan headers 1.4.309" in vulkan.toolkit.reason
    assert found.wanted() == ["vulkan", "cpu"]
    assert found.best_buildable() == "vulkan"


def test_a_software_vulkan_device_alone_is_never_preferred_over_the_cpu_engine():
    found = detect(machine(tools=["vulkaninfo", "glslc"], files=vulkan_dev_files(),
                           outputs={"vulkaninfo": VULKANINFO_LAVAPIPE}))
    assert found.get("vulkan").usable
    assert "software only" in found.get("vulkan").reason
    assert found.wanted() == ["cpu"]


def test_vulkan_without_build_tools_names_the_debian_packages():
    files = {"/usr/lib/x86_64-linux-gnu/libvulkan.so.1": "",
             "/usr/share/vulkan/icd.d/radeon_icd.x86_64.json": "{}"}
    vulkan = detect(machine(files=files)).get("vulkan")
    assert vulkan.usable  # a driver is installed, so the loader will find a device
    assert not vulkan.buildable
    assert vulkan.toolkit.install == "sudo apt-get install glslc spirv-headers libvulkan-dev"


def test_debian_12_vulkan_headers_are_too_old_but_the_build_fetches_newer_ones():
    files = vulkan_dev_files(core=OLD_VULKAN_CORE, structs="// no layer settings here")
    vulkan = detect(machine(tools=["vulkaninfo", "glslc"], files=files,
                            outputs={"vulkaninfo": VULKANINFO_DISCRETE})).get("vulkan")
    assert vulkan.buildable
    assert "1.3.239 are too old" in vulkan.toolkit.reason
    assert "fetches newer ones" in vulkan.toolkit.reason


def test_old_vulkan_headers_elsewhere_say_which_version_is_needed():
    files = vulkan_dev_files(core=OLD_VULKAN_CORE, structs="")
    files["/etc/os-release"] = 'ID=fedora\nVERSION_ID="38"\n'
    vulkan = detect(machine(tools=["glslc"], files=files)).get("vulkan")
    assert not vulkan.buildable
    assert "LayerSettingEXT" in vulkan.toolkit.reason


@pytest.mark.parametrize("arch, wanted", [("arm64", ["metal", "cpu"]), ("x86_64", ["cpu"])])
def test_macos_uses_metal_on_apple_silicon_only(arch, wanted):
    found = detect(machine(system="Darwin", arch=arch, outputs={"sysctl": "17179869184\n"}))
    assert found.wanted() == wanted
    assert not found.get("cuda").usable and not found.get("vulkan").usable
    if arch == "arm64":
        assert found.get("metal").devices[0].memory_mib == 16384
        assert found.best_buildable() == "metal"


def test_rocm_gpus_are_listed_by_rocminfo():
    rocminfo = ("*******\nAgent 1\n*******\n  Name: AMD Ryzen\n  Device Type: CPU\n"
                "*******\nAgent 2\n*******\n  Marketing Name: AMD Radeon RX 7900 XTX\n"
                "  Device Type: GPU\n")
    found = detect(machine(tools=["rocminfo"], files={"/dev/kfd": ""},
                           outputs={"rocminfo": rocminfo}))
    hip = found.get("hip")
    assert [d.name for d in hip.devices] == ["AMD Radeon RX 7900 XTX"]
    assert not hip.buildable and "hipcc" in hip.toolkit.reason
    assert found.wanted() == ["hip", "cpu"]


def test_status_lines_and_json_say_why_for_every_backend():
    found = detect(machine(tools=["nvidia-smi"], outputs={"nvidia-smi": NVIDIA_SMI}))
    text = "\n".join(found.describe())
    assert "NVIDIA GeForce RTX 4070, 12282 MiB" in text
    assert "install: pip install nvidia-cuda-nvcc" in text
    data = found.to_dict()
    assert data["best_buildable"] == "cpu"
    assert {b["backend"] for b in data["backends"]} == {"cpu", "cuda", "hip", "metal", "vulkan"}
    assert all(b["reason"] for b in data["backends"])


NVIDIA_SMI_24GB = "NVIDIA GeForce RTX 4090, 24564\n"


def test_the_fit_badge_counts_the_memory_of_gpus_the_engines_offload_to():
    found = detect(machine(tools=["nvidia-smi"], outputs={"nvidia-smi": NVIDIA_SMI_24GB}))
    assert found.offload_memory() == [("NVIDIA GeForce RTX 4090", 24564 * 1024 * 1024)]
    assert detect(machine()).offload_memory() == []


def test_software_vulkan_and_devices_without_a_reported_size_add_no_gpu_memory():
    # lavapipe reports the host's RAM as its memory and runs on the CPU: not GPU memory.
    lavapipe = detect(machine(tools=["vulkaninfo"], outputs={"vulkaninfo": VULKANINFO_LAVAPIPE}))
    assert lavapipe.get("vulkan").usable and lavapipe.offload_memory() == []
    # vulkaninfo --summary names a discrete GPU but not its size: nothing to count on.
    discrete = detect(machine(tools=["vulkaninfo"], outputs={"vulkaninfo": VULKANINFO_DISCRETE}))
    assert discrete.offload_memory() == []


def test_apple_unified_memory_counts_what_metal_may_wire():
    found = detect(machine(system="Darwin", arch="arm64", outputs={"sysctl": "17179869184\n"}))
    assert found.offload_memory() == [("Apple GPU (unified memory)", 12 * 1024 ** 3)]
