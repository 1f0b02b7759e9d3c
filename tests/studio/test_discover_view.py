"""The "Get models" tab driven like a person would: search, pick, see the badge, download,
pause, resume, and find the model in the library ready to load.

Against the local Hugging Face endpoint (tests/hf_endpoint.py); the engine is real.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt

from backend.models.download import DownloadState
from backend.models.hub import curated_models
from backend.llama.load import State
from studio.window import GET_MODELS_TAB
from tests.conftest import CODER_REPO

WAIT = 15_000
LOAD_WAIT = 60_000
MiB = 1024 * 1024


def click(qtbot, button) -> None:
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)


def test_search_pick_download_pause_resume_then_load(open_window, qtbot, hf_hub, with_engine: Path):
    window = open_window()
    d = window.discover
    # Start-up touched no network: the curated list is package data.
    assert d.repos.count() == len(curated_models())
    assert hf_hub.requests == []
    window.library_view.get_models_button.click()  # the empty library's way forward
    assert window.tabs.currentIndex() == GET_MODELS_TAB

    d.query.setText("tiny")
    click(qtbot, d.search_button)
    qtbot.waitUntil(lambda: d.repos.count() == 2 and d.search_button.isEnabled(), timeout=WAIT)
    assert d.repos.item(0).text().startswith(CODER_REPO)

    d.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: d.files.topLevelItemCount() == 2, timeout=WAIT)
    q4_group = d.files.topLevelItem(0)
    assert q4_group.text(0) == "Q4_K_M"
    q4 = q4_group.child(0)
    assert (q4.text(0), q4.text(1), q4.text(2)) == ("Tiny-Coder-Q4_K_M", "16.6 MiB", "fits in RAM")
    assert q4.toolTip(2).startswith("Needs about") and "RAM" in q4.toolTip(2)
    assert "8,192 tokens of context" in q4.toolTip(2)

    # Another context: new numbers, worked out here without asking the hub again.
    asked = len(hf_hub.requests)
    d.context.setValue(65536)
    d.context.editingFinished.emit()
    qtbot.waitUntil(lambda: "65,536 tokens of context" in d.files.topLevelItem(0).child(0).toolTip(2),
                    timeout=WAIT)
    assert len(hf_hub.requests) == asked
    q4 = d.files.topLevelItem(0).child(0)

    # Download; the endpoint holds after 2 MiB so the pause lands at a known point.
    hf_hub.hold(after=2 * MiB)
    d.files.setCurrentItem(q4)
    click(qtbot, d.download_button)
    qtbot.waitUntil(lambda: len(d.rows) == 1, timeout=WAIT)
    [row] = d.rows.values()
    qtbot.waitUntil(lambda: row.bar.value() > 0 and hf_hub.holding.is_set(), timeout=WAIT)
    assert "of 16.6 MiB" in row.detail.text()
    assert row.pause_button.text() == "Pause"
    click(qtbot, row.pause_button)
    hf_hub.release()
    qtbot.waitUntil(lambda: row.state == DownloadState.PAUSED, timeout=WAIT)
    assert row.pause_button.text() == "Resume" and 0 < row.bar.value() < 1000
    kept = hf_hub.served[-1].sent  # at least what reached the disk
    assert kept > 0

    click(qtbot, row.pause_button)
    qtbot.waitUntil(lambda: row.state == DownloadState.DONE, timeout=WAIT)
    assert row.bar.value() == 1000 and row.detail.text() == "Ready in the library."
    assert hf_hub.served[-1].start > 0  # resumed, not started over

    # The library shows it, selected, and it loads.
    entry = window.library_view.current_entry
    qtbot.waitUntil(lambda: entry() is not None and entry().name == "Tiny-Coder-Q4_K_M", timeout=WAIT)
    assert entry().detail == CODER_REPO
    view = window.model_view
    qtbot.waitUntil(lambda: view.info is not None, timeout=WAIT)  # its header was read
    assert view.facts["architecture"].text() == "llama"
    view.ctx_size.setValue(1024)
    click(qtbot, view.load_button)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)


def test_errors_are_shown_as_sentences(open_window, qtbot, hf_hub):
    window = open_window()
    d = window.discover
    d.query.setText("tiny")
    hf_hub.repos.clear()  # the repository vanished between search and listing
    click(qtbot, d.search_button)
    qtbot.waitUntil(lambda: d.search_button.isEnabled(), timeout=WAIT)
    assert d.repos_title.text() == "No GGUF repositories match"
    d.show_curated()
    d.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: "No repository" in d.status.text(), timeout=WAIT)
    assert hf_hub.url not in d.status.text()


def test_a_gated_model_downloads_once_a_token_is_saved_from_the_tab(open_window, qtbot, hf_hub,
                                                                     monkeypatch):
    from PySide6.QtWidgets import QInputDialog

    from backend.models.hub import token_path
    from tests.conftest import GATED_REPO

    window = open_window()
    d = window.discover
    d.query.setText("gated")
    click(qtbot, d.search_button)
    qtbot.waitUntil(lambda: d.repos.count() == 1, timeout=WAIT)
    d.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: d.files.topLevelItemCount() == 1, timeout=WAIT)
    assert "gated" in d.repo_title.text()
    d.files.setCurrentItem(d.files.topLevelItem(0).child(0))
    click(qtbot, d.download_button)
    qtbot.waitUntil(lambda: len(d.rows) == 1 and next(iter(d.rows.values())).state == DownloadState.FAILED, timeout=WAIT)
    [row] = d.rows.values()
    assert "is gated" in row.detail.text() and row.pause_button.text() == "Resume"

    # The modal dialog answers as a person would type the token.
    token = hf_hub.repos[GATED_REPO].token
    monkeypatch.setattr(QInputDialog, "getText", staticmethod(lambda *args, **kwargs: (token, True)))
    click(qtbot, d.token_button)
    qtbot.waitUntil(token_path().is_file, timeout=WAIT)
    click(qtbot, row.pause_button)  # "Resume" retries with the saved token
    qtbot.waitUntil(lambda: row.state == DownloadState.DONE, timeout=WAIT)
    entry = window.library_view.current_entry
    qtbot.waitUntil(lambda: entry() is not None and entry().detail == GATED_REPO, timeout=WAIT)


def _badge_with(open_window, qtbot, monkeypatch, found):
    """The tab's badge for the tiny Q4 model on a machine whose detection found `found`
    (fake probes: this machine's own GPUs would make the answer vary)."""
    import backend.llama.engine

    monkeypatch.setattr(backend.llama.engine, "_DETECTED", found)
    d = open_window().discover
    d.query.setText("tiny")
    click(qtbot, d.search_button)
    qtbot.waitUntil(lambda: d.repos.count() == 2 and d.search_button.isEnabled(), timeout=WAIT)
    d.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: d.files.topLevelItemCount() == 2, timeout=WAIT)
    q4 = d.files.topLevelItem(0).child(0)
    return q4.text(2), q4.toolTip(2)


def test_a_model_fits_in_gpu_on_a_machine_with_a_24_gb_gpu(open_window, qtbot, hf_hub, monkeypatch):
    from backend.llama.accelerators import detect
    from tests.backend.llama.test_accelerators import NVIDIA_SMI_24GB, machine

    badge, hover = _badge_with(open_window, qtbot, monkeypatch, detect(
        machine(tools=["nvidia-smi"], outputs={"nvidia-smi": NVIDIA_SMI_24GB})))
    assert badge == "fits in GPU"
    assert "24.0 GiB (NVIDIA GeForce RTX 4090) GPU memory" in hover


def test_a_model_fits_in_ram_on_a_machine_without_a_gpu(open_window, qtbot, hf_hub, monkeypatch):
    from backend.llama.accelerators import detect
    from tests.backend.llama.test_accelerators import VULKANINFO_LAVAPIPE, machine

    # Only lavapipe (software Vulkan, whose memory is the host's): no GPU memory.
    badge, hover = _badge_with(open_window, qtbot, monkeypatch, detect(
        machine(tools=["vulkaninfo"], outputs={"vulkaninfo": VULKANINFO_LAVAPIPE})))
    assert badge == "fits in RAM"
    assert "GPU" not in hover and "RAM" in hover


def test_hub_strings_are_shown_as_plain_text_not_markup(open_window, qtbot, hf_hub, coder_models):
    from tests.hf_endpoint import HubRepo

    q4 = coder_models["Tiny-Coder-Q4_K_M.gguf"]
    hf_hub.repos["test-org/Bold-GGUF"] = HubRepo("test-org/Bold-GGUF", {"<b>Bold<b>-Q4_K_M.gguf": q4})
    hf_hub.repos["test-org/Bold-Evil-GGUF"] = HubRepo("test-org/Bold-Evil-GGUF", {"<i>x</i>/../../x.gguf": q4})
    window = open_window()
    d = window.discover
    d.query.setText("bold")
    click(qtbot, d.search_button)
    qtbot.waitUntil(lambda: d.repos.count() == 2 and d.search_button.isEnabled(), timeout=WAIT)
    rows = [d.repos.item(i).text().split("\n")[0] for i in range(2)]

    d.repos.setCurrentRow(rows.index("test-org/Bold-Evil-GGUF"))
    qtbot.waitUntil(lambda: "refused" in d.status.text(), timeout=WAIT)
    assert "“<i>x</i>/../../x.gguf”" in d.status.text()
    assert d.status.textFormat() == Qt.TextFormat.PlainText

    d.repos.setCurrentRow(rows.index("test-org/Bold-GGUF"))
    qtbot.waitUntil(lambda: d.files.topLevelItemCount() == 1, timeout=WAIT)
    assert d.repo_title.textFormat() == Qt.TextFormat.PlainText
    d.files.setCurrentItem(d.files.topLevelItem(0).child(0))
    click(qtbot, d.download_button)
    qtbot.waitUntil(lambda: len(d.rows) == 1 and next(iter(d.rows.values())).state == DownloadState.DONE, timeout=WAIT)
    [row] = d.rows.values()
    assert row.name.text() == "<b>Bold<b>-Q4_K_M"
    assert row.name.textFormat() == row.detail.textFormat() == Qt.TextFormat.PlainText
