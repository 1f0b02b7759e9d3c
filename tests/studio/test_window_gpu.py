"""The window's GPU parts: the GPU-layers choice, where the model runs, Retry on CPU,
and the accelerators on the Engine tab."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt

from backend.app.model_account import model_account
from backend.llama.report import DeviceUse, EngineReport
from backend.llama.load import LoadSettings, Serving, Snapshot, State

WAIT = 10_000
LOAD_WAIT = 60_000

VULKAN_REPORT = EngineReport(
    "vulkan", (DeviceUse("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", 24000, 15.6, 4.0, 9.0),
               DeviceUse("CPU", model_mib=0.5)), 3, 3, 8192, 131072)


def test_gpu_layers_default_to_automatic_and_offer_all_none_or_a_number(open_window, qtbot,
                                                                        tiny_model: Path) -> None:
    window = open_window()
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    view = window.model_view
    assert view.gpu_layers.currentText() == "Automatic (what fits)"
    assert view.load_settings().n_gpu_layers == "auto"
    view.gpu_layers.setCurrentText("None (CPU only)")
    assert view.load_settings().n_gpu_layers == "none"
    view.gpu_layers.setCurrentText("12")
    assert view.load_settings().n_gpu_layers == "12"
    view.set_load_settings(LoadSettings(n_gpu_layers="all"))
    assert view.gpu_layers.currentText() == "All"

    view.gpu_layers.setCurrentText("lots")
    qtbot.mouseClick(view.load_button, Qt.MouseButton.LeftButton)
    assert "auto, all, none or a number" in view.settings_error.text()
    assert window.bridge.snapshot.state is State.STOPPED


def test_the_model_tab_says_where_the_model_runs_as_the_engine_reported_it(open_window) -> None:
    view = open_window().model_view
    ready = Snapshot(state=State.READY, model_id="m", serving=Serving("http://e", 4, 2048),
                     engine=VULKAN_REPORT)
    view.show_account(model_account(ready, None))
    assert view.state.text().endswith("; on Vulkan0, 29 MiB")  # where, in plain words
    text = view.details.text()
    assert "3/3 layers on Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))" in text
    assert "Vulkan0 29 MiB" in text
    assert "context 8,192 tokens in total" in text and "shrunk from 131,072" in text
    assert not view.cpu_retry_button.isVisible()
    view.show_account(model_account(Snapshot(state=State.STOPPED), None))
    assert "Runs on" not in view.details.text() and "Vulkan0" not in view.state.text()


def test_a_failed_gpu_load_offers_retry_on_cpu_which_loads_without_gpu_layers(
        open_window, qtbot, with_engine: Path, tiny_model: Path) -> None:
    window = open_window()
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    qtbot.mouseClick(window.model_view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    first_log = window.bridge.snapshot.log_path
    assert "--n-gpu-layers auto --fit on" in Path(first_log).read_text().splitlines()[0]

    # This machine has no GPU to fail on: show the view what a failed GPU load looks like.
    failed = replace(window.bridge.snapshot, state=State.FAILED, serving=None, cpu_retry_offered=True,
                     error="The GPU ran out of memory while loading the model.")
    window.model_view.show_account(model_account(failed, None), cpu_retry=True)
    assert window.model_view.cpu_retry_button.isVisible()
    qtbot.mouseClick(window.model_view.cpu_retry_button, Qt.MouseButton.LeftButton)

    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY
                    and window.bridge.snapshot.log_path != first_log, timeout=LOAD_WAIT)
    command = Path(window.bridge.snapshot.log_path).read_text().splitlines()[0]
    assert "--n-gpu-layers 0 --device none --fit off" in command
    qtbot.waitUntil(lambda: not window.model_view.cpu_retry_button.isVisible(), timeout=WAIT)
    # An engine built with RPC counts the layers it keeps on the CPU; one from before does not.
    qtbot.waitUntil(lambda: re.search(r"Runs on the CPU( \(all 3 layers\))?;",
                                      window.model_view.details.text()) is not None, timeout=WAIT)


def test_the_engine_tab_lists_the_accelerators_found(open_window, qtbot) -> None:
    window = open_window()
    engine = window.engine
    qtbot.waitUntil(lambda: engine.accelerators.text().startswith("GPUs:"), timeout=WAIT)
    backends = [row[0] for row in engine.accelerator_rows() if row[0]]
    assert {"cuda", "hip", "vulkan", "cpu"} <= set(backends)
    assert ("cpu", "yes", "always available; every layer on the CPU") in engine.accelerator_rows()


def test_the_engine_tab_offers_the_best_engine_the_computer_can_build(open_window) -> None:
    from backend.llama.accelerators import detect
    from tests.backend.llama.test_accelerators import (
        NVIDIA_SMI, VULKANINFO_DISCRETE, machine, vulkan_dev_files,
    )

    view = open_window().engine
    view.set_accelerators(detect(machine(tools=["vulkaninfo", "glslc"], files=vulkan_dev_files(),
                                         outputs={"vulkaninfo": VULKANINFO_DISCRETE})))
    assert view.backend_to_build == "vulkan"
    assert view.build_button.text() == "&Build the vulkan engine"
    # An NVIDIA card without a toolkit: the CPU engine is what can be built, and the
    # tab says what to install for the GPU.
    view.set_accelerators(detect(machine(tools=["nvidia-smi"], outputs={"nvidia-smi": NVIDIA_SMI})))
    assert view.backend_to_build == "cpu"
    assert view.build_button.text() == "&Build llama-server"
    assert any(why.startswith("install: pip install nvidia-cuda-nvcc")
               for _backend, _usable, why in view.accelerator_rows())
