"""Reading where the model runs and its KV cache from llama-server's own load output."""

from __future__ import annotations

from pathlib import Path

from backend.llama.report import EngineReportReader, gpu_failure_reason
from backend.llama.kv_capacity import KvCapacity
from backend.llama.load import LoadSpec
from backend.llama.supervisor import Supervisor
from tests.not_none import not_none

# Captured from the CPU engine loading the tiny model (--verbosity 4), trimmed.
CPU_LOAD = """\
0.00.008.606 I cmn  common_param:   - CPU     : AMD EPYC (24105 MiB, 24105 MiB free)
0.00.009.252 I cmn  common_init_: fitting params to device memory ...
0.00.192.543 I common_memory_breakdown_print: |   - Host               |                   28 =    15 +       4 +       9                |
0.00.194.665 I common_params_fit_impl: will leave 24076 >= 1024 MiB of system memory, no changes needed
0.00.257.928 I load_tensors: loading model tensors, this can take a while... (load_mode = mmap)
0.00.258.552 I load_tensors:   CPU_Mapped model buffer size =    15.94 MiB
0.00.258.993 I llama_context: n_ctx                 = 8192
0.00.259.007 I llama_context: n_ctx_seq             = 8192
0.00.259.172 I llama_context:        CPU  output buffer size =     0.49 MiB
0.00.259.244 I llama_kv_cache:        CPU KV buffer size =     4.00 MiB
0.00.266.614 I sched_reserve:        CPU compute buffer size =     9.01 MiB
"""

# Captured from the Vulkan engine loading the tiny model on lavapipe (default settings).
VULKAN_LOAD = """\
0.00.048.746 I cmn  common_param:   - Vulkan0 : llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)
0.00.127.137 I common_params_fit_impl: projected to use 21 MiB of device memory vs. 2048 MiB of free device memory
0.00.131.371 I common_params_fit_impl: will leave 2026 >= 1024 MiB of free device memory, no changes needed
0.00.145.984 I llama_prepare_model_devices: using device Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)) (unknown id) - 2048 MiB free
0.00.174.118 I load_tensors: loading model tensors, this can take a while... (load_mode = mmap)
0.00.175.105 I load_tensors: offloading output layer to GPU
0.00.175.225 I load_tensors: offloading 1 repeating layers to GPU
0.00.175.300 I load_tensors: offloaded 3/3 layers to GPU
0.00.175.376 I load_tensors:   CPU_Mapped model buffer size =     7.81 MiB
0.00.175.466 I load_tensors:      Vulkan0 model buffer size =     8.13 MiB
0.00.180.676 I llama_context: n_ctx                 = 8192
0.00.182.384 I llama_context: Vulkan_Host  output buffer size =     0.49 MiB
0.00.182.458 I llama_kv_cache:    Vulkan0 KV buffer size =     4.00 MiB
0.00.188.580 I sched_reserve:    Vulkan0 compute buffer size =     9.01 MiB
0.00.188.776 I sched_reserve: Vulkan_Host compute buffer size =     8.26 MiB
"""

# Captured from the CPU engine loading the tiny model with all layers on an RPC worker
# (`--rpc 127.0.0.1:44135 --n-gpu-layers all`), trimmed.
RPC_LOAD = """\
0.00.009.662 I cmn  common_param:   - RPC0    : 127.0.0.1:44135 (24105 MiB, 24105 MiB free)
0.00.069.299 I common_memory_breakdown_print: |   - RPC0 (127.0.0.1:44135) | 24105 = 24105 + (  10 =     8 +       0 +       2) +         -10 |
0.00.088.336 I llama_prepare_model_devices: using device RPC0 (127.0.0.1:44135) (unknown id) - 24105 MiB free
0.00.137.390 I load_tensors: offloaded 3/3 layers to GPU
0.00.137.395 I load_tensors:   CPU_Mapped model buffer size =     7.81 MiB
0.00.137.396 I load_tensors: RPC0[127.0.0.1:44135] model buffer size =     8.13 MiB
0.00.156.237 I llama_context:        CPU  output buffer size =     0.12 MiB
0.00.168.223 I llama_kv_cache: RPC0[127.0.0.1:44135] KV buffer size =     0.50 MiB
0.00.169.416 I sched_reserve: RPC0[127.0.0.1:44135] compute buffer size =     2.13 MiB
0.00.169.442 I sched_reserve:        CPU compute buffer size =     1.26 MiB
"""


def read(text: str):
    reader = EngineReportReader()
    for line in text.splitlines():
        reader.feed(line)
    return reader.report()


def read_kv(*lines: str) -> KvCapacity | None:
    reader = EngineReportReader()
    for line in lines:
        reader.feed(line)
    return reader.kv_capacity()


INIT = "0.00.203.455 I srv    load_model: initializing, n_slots = {}, n_ctx_slot = {}, kv_unified = '{}'"


def test_a_cpu_load_reports_every_buffer_on_the_host_and_the_context():
    report = read(CPU_LOAD)
    assert report.backend == "cpu" and not report.on_gpu
    (host,) = report.devices
    assert (host.name, host.model_mib, host.kv_mib, host.compute_mib) == ("CPU", 15.94, 4.0, 9.01)
    assert report.context_size == 8192
    assert report.summary() == "the CPU; memory: 29 MiB"


def test_a_vulkan_load_reports_the_device_its_layers_and_memory_on_each_side():
    report = read(VULKAN_LOAD)
    assert report.backend == "vulkan" and report.on_gpu
    assert (report.layers_offloaded, report.layers_total) == (3, 3)
    gpu, host = report.devices
    assert (gpu.name, gpu.description, gpu.free_mib) == (
        "Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", 2048)
    assert (gpu.model_mib, gpu.kv_mib, gpu.compute_mib) == (8.13, 4.0, 9.01)
    # Host-side buffers of the GPU backend (pinned staging) count as the CPU's memory.
    assert host.name == "CPU" and round(host.total_mib, 2) == 16.07
    assert report.summary() == ("vulkan: 3/3 layers on Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)); "
                                "memory: Vulkan0 21 MiB, CPU 16 MiB")
    assert report.to_dict()["devices"][0]["total_mib"] == 21.14


def test_an_rpc_load_reports_the_workers_device_with_its_address_and_its_buffers():
    report = read(RPC_LOAD)
    assert report.backend == "rpc" and report.on_gpu
    worker, host = report.devices
    assert (worker.name, worker.description, worker.free_mib) == ("RPC0", "127.0.0.1:44135", 24105)
    assert (worker.model_mib, worker.kv_mib, worker.compute_mib) == (8.13, 0.5, 2.13)
    assert host.name == "CPU" and host.model_mib == 7.81
    assert report.summary() == ("rpc: 3/3 layers on RPC0 (127.0.0.1:44135); "
                                "memory: RPC0 11 MiB, CPU 9 MiB")


def test_buffers_measured_by_fit_before_the_real_load_are_not_counted_twice():
    dry_run = "0.00.1 I load_tensors:      Vulkan0 model buffer size =   100.00 MiB\n"
    report = read(dry_run + CPU_LOAD)
    assert [d.name for d in report.devices if d.total_mib] == ["CPU"]


def test_a_context_shrunk_by_fit_says_from_what():
    report = read("common_params_fit_impl: context size reduced from 131072 to 32768 -> need "
                  "4096 MiB less memory in total\n" + CPU_LOAD.replace("8192", "32768"))
    assert (report.context_reduced_from, report.context_size) == (131072, 32768)


def test_a_split_cache_gives_each_slot_its_own_share():
    assert read_kv(INIT.format(2, 8192, "false")) == KvCapacity(16384, 8192, unified=False)


def test_a_unified_pool_nothing_capped_is_one_slots_context():
    assert read_kv("llama_server: initializing ...", INIT.format(4, 32768, "true")) == \
        KvCapacity(32768, 32768, unified=True)


def test_a_pool_larger_than_the_training_context_is_read_from_the_capping_warning():
    # The tiny test model, Auto slots, --ctx-size 16384 (captured from a real load).
    assert read_kv(
        "0.00.186.836 W llama_context: n_ctx_seq (16384) > n_ctx_train (8192) -- possible "
        "training context overflow",
        "0.00.202.230 W srv    load_model: the slot context (16384) exceeds the training "
        "context of the model (8192) - capping",
        INIT.format(4, 8192, "true")) == KvCapacity(16384, 8192, unified=True)


def test_kv_unified_per_slot_caps_one_request_below_the_pool():
    assert read_kv("I srv load_model: capping per-slot context (32768) to --kv-unified-per-slot (8192)",
                   INIT.format(4, 8192, "true")) == KvCapacity(32768, 8192, unified=True)


def test_the_real_loads_context_wins_over_fits_dry_run():
    assert read_kv("llama_context: n_ctx                 = 65536",  # --fit measuring
                   "llama_context: n_ctx                 = 24576",  # the real load (verbosity 4)
                   INIT.format(4, 24576, "true")) == KvCapacity(24576, 24576, unified=True)


def test_no_load_line_means_unknown():
    assert read_kv("llama_server: model loaded") is None


def test_one_reading_gives_the_report_and_the_kv_cache_from_the_same_context():
    reader = EngineReportReader()
    for line in (CPU_LOAD + INIT.format(2, 4096, "true")).splitlines():
        reader.feed(line)
    assert reader.report().context_size == 8192
    assert reader.kv_capacity() == KvCapacity(8192, 4096, unified=True)


def test_gpu_failures_are_worded_for_people_and_other_failures_are_not_blamed_on_the_gpu():
    oom = ["ggml_vulkan: Device memory allocation of size 4294967296 failed.",
           "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory",
           "llama_init_from_model: failed to initialize the context"]
    assert "ran out of memory" in not_none(gpu_failure_reason(oom))
    driver = ["ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient "
              "for CUDA runtime version"]
    assert "driver" in not_none(gpu_failure_reason(driver))
    too_big = ["ggml/src/ggml-backend.cpp:941: pre-allocated tensor (cache_k_l0) in a buffer "
               "(Vulkan0) that cannot run the operation (NONE)"]
    assert "context is too large" in not_none(gpu_failure_reason(too_big))
    assert gpu_failure_reason(["error: failed to open GGUF file '/m.gguf'"]) is None


async def test_a_real_cpu_load_carries_its_report_in_the_snapshot(tmp_path: Path,
                                                                 llama_server_binary, tiny_model):
    supervisor = Supervisor(llama_server_binary, tmp_path / "logs", load_timeout=60)
    try:
        snapshot = await supervisor.load(LoadSpec(str(tiny_model)))
    finally:
        await supervisor.close()
    report = snapshot.engine
    assert report is not None and report.backend == "cpu" and not report.on_gpu
    host = report.devices[-1]
    assert host.name == "CPU" and host.model_mib > 0 and host.kv_mib > 0
    serving = not_none(snapshot.serving)
    assert report.context_size is not None and serving.context_length is not None
    assert report.context_size >= serving.context_length
