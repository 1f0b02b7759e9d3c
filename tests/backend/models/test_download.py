"""Downloading into the Hugging Face cache: progress, pause and resume, verification, the queue.

The endpoint is local (tests/hf_endpoint.py) and counts the bytes it serves; the
client is the real huggingface_hub; the model that arrives is loaded by the real
llama-server and answers through the port.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from backend.errors import (
    ChecksumMismatch,
    DownloadFailed,
    HubAccessDenied,
    HubNotFound,
    HubUnreachable,
)
from backend.models.download import (
    DownloadProgress,
    DownloadState,
    DownloadStopped,
    StopReason,
    Stopper,
    bytes_on_disk,
    download_model,
    repo_folder,
)
from backend.models.download_queue import DownloadQueue
from backend.models.hub import HubFile, ModelChoice, list_repo, pick_choice
from backend.models.library import ModelLibrary
from backend.app.self_test import run_self_test
from tests.conftest import BROKEN_REPO, CODER_REPO, GATED_REPO, HUGE_REPO, SPLIT_REPO

Q4 = "Tiny-Coder-Q4_K_M.gguf"
MiB = 1024 * 1024


def library_names(tmp_path: Path) -> list[str]:
    return [e.name for e in ModelLibrary(tmp_path / "library.json").scan() if e.source == "huggingface"]


def cache_files(repo_id: str) -> list[str]:
    folder = repo_folder(repo_id)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()) \
        if folder.exists() else []


def test_a_download_lands_in_the_hf_cache_and_the_library_lists_it(hf_hub, tmp_path, coder_models):
    listing = list_repo(CODER_REPO)
    choice = pick_choice(listing, "Q4_K_M")
    seen: list[int] = []
    path = download_model(choice, listing.commit, on_bytes=seen.append)
    assert sum(seen) == choice.size and len(seen) > 1  # progress came in pieces
    assert path.read_bytes() == coder_models[Q4].read_bytes()
    # The standard layout, so other tools (and llama.cpp's -hf) share the file.
    folder = repo_folder(CODER_REPO)
    assert path == folder / "snapshots" / listing.commit / Q4
    assert path.is_symlink() and path.resolve().parent == folder / "blobs"
    assert (folder / "refs" / "main").read_text() == listing.commit
    assert library_names(tmp_path) == ["Tiny-Coder-Q4_K_M"]


def test_a_paused_download_resumes_without_fetching_any_byte_twice(hf_hub, tmp_path):
    listing = list_repo(CODER_REPO)
    choice = pick_choice(listing, "Q4_K_M")
    stopper = Stopper()
    written = 0

    def pause_after_three_mib(n: int) -> None:
        nonlocal written
        written += n
        if written >= 3 * MiB:
            stopper.stop(StopReason.PAUSE)

    with pytest.raises(DownloadStopped):
        download_model(choice, listing.commit, stopper=stopper, on_bytes=pause_after_three_mib)
    kept = bytes_on_disk(choice, listing.commit)
    assert kept == written >= 3 * MiB
    assert library_names(tmp_path) == []  # half a model is not a model

    # A new call (as after a restart) picks up where the bytes on disk end.
    path = download_model(choice, listing.commit)
    first, resumed = [s for s in hf_hub.served if s.path == Q4]
    assert (first.start, resumed.start, resumed.status) == (0, kept, 206)
    assert resumed.sent == choice.size - kept  # only the missing bytes were served
    assert hashlib.sha256(path.read_bytes()).hexdigest() == choice.files[0].sha256
    assert library_names(tmp_path) == ["Tiny-Coder-Q4_K_M"]


def test_a_server_that_ignores_the_range_restarts_the_file_and_it_still_verifies(hf_hub):
    listing = list_repo(CODER_REPO)
    choice = pick_choice(listing, "Q4_K_M")
    stopper = Stopper()
    with pytest.raises(DownloadStopped):
        download_model(choice, listing.commit, stopper=stopper, on_bytes=lambda n: stopper.stop(StopReason.PAUSE))
    assert bytes_on_disk(choice, listing.commit) > 0
    hf_hub.ignore_ranges = True
    path = download_model(choice, listing.commit)  # the kept bytes are dropped, not doubled
    assert (hf_hub.served[-1].start, hf_hub.served[-1].status) == (0, 200)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == choice.files[0].sha256


def test_a_checksum_mismatch_is_refused_and_leaves_nothing_in_the_cache(hf_hub, tmp_path):
    listing = list_repo(BROKEN_REPO)
    with pytest.raises(ChecksumMismatch) as caught:
        download_model(pick_choice(listing), listing.commit)
    assert "does not match the SHA-256" in str(caught.value)
    assert hf_hub.bytes_served(Q4) > 0  # it was downloaded, then refused
    assert cache_files(BROKEN_REPO) == []
    assert library_names(tmp_path) == []


def test_a_cancelled_download_leaves_nothing_behind(hf_hub, tmp_path):
    listing = list_repo(CODER_REPO)
    choice = pick_choice(listing, "Q8_0")
    stopper = Stopper()
    with pytest.raises(DownloadStopped):
        download_model(choice, listing.commit, stopper=stopper,
                       on_bytes=lambda n: stopper.stop(StopReason.CANCEL))
    assert bytes_on_disk(choice, listing.commit) == 0
    assert cache_files(CODER_REPO) == []


def test_a_gated_repository_needs_a_token_that_has_access(hf_hub, tmp_path, monkeypatch):
    listing = list_repo(GATED_REPO)
    assert listing.gated
    choice = pick_choice(listing)
    with pytest.raises(HubAccessDenied) as caught:
        download_model(choice, listing.commit)
    assert "is gated" in str(caught.value) and "HF_TOKEN" in str(caught.value)
    assert cache_files(GATED_REPO) == []
    monkeypatch.setenv("HF_TOKEN", hf_hub.repos[GATED_REPO].token)
    assert download_model(choice, listing.commit).is_file()


def test_a_file_gone_from_the_repository_is_a_readable_not_found(hf_hub):
    listing = list_repo(CODER_REPO)
    gone = ModelChoice(CODER_REPO, "Gone", "Q2_K", (HubFile("Gone-Q2_K.gguf", 10, "e" * 64),))
    with pytest.raises(HubNotFound, match="no longer in test-org/Tiny-Coder-GGUF"):
        download_model(gone, listing.commit)


def test_offline_a_download_fails_with_a_sentence_and_keeps_nothing(hf_hub, monkeypatch):
    listing = list_repo(CODER_REPO)
    with socket.socket() as s:  # the network goes away after the listing
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    with pytest.raises(HubUnreachable, match="cannot be reached"):
        download_model(pick_choice(listing), listing.commit)
    assert cache_files(CODER_REPO) == []


def test_a_model_bigger_than_the_free_disk_is_refused_before_any_byte(hf_hub):
    listing = list_repo(HUGE_REPO)
    with pytest.raises(DownloadFailed, match="Not enough disk space") as caught:
        download_model(pick_choice(listing), listing.commit)
    assert "free" in str(caught.value)
    assert hf_hub.served == []


def unwritable_cache(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        return locked / "hub"
    return Path("/sys/gguf-studio-test-hub")  # root may write anywhere, but not in sysfs


def test_a_cache_folder_that_cannot_be_written_is_a_readable_refusal(hf_hub, tmp_path, monkeypatch):
    cache = unwritable_cache(tmp_path)
    listing = list_repo(CODER_REPO)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(DownloadFailed, match="may not write to the Hugging Face cache folder") as caught:
        download_model(pick_choice(listing), listing.commit)
    assert str(cache) not in str(caught.value)
    assert not cache.exists()


async def test_the_downloaded_model_loads_and_answers_through_the_port(hf_hub, llama_server_binary):
    listing = list_repo(CODER_REPO)
    path = download_model(pick_choice(listing, "Q8_0"), listing.commit)
    assert await run_self_test(path, llama_server=llama_server_binary) == 0


async def test_a_split_model_downloads_as_one_and_appears_only_when_whole(hf_hub, tmp_path,
                                                                          llama_server_binary):
    listing = list_repo(SPLIT_REPO)
    [choice] = listing.choices
    assert len(choice.files) == 2 and choice.quant == "Q8_0"
    stopper = Stopper()

    def pause_in_the_second_part(n: int) -> None:
        if hf_hub.served and hf_hub.served[-1].path.endswith("00002-of-00002.gguf"):
            stopper.stop(StopReason.PAUSE)

    with pytest.raises(DownloadStopped):
        download_model(choice, listing.commit, stopper=stopper, on_bytes=pause_in_the_second_part)
    assert bytes_on_disk(choice, listing.commit) > choice.files[0].size  # part 1 is kept...
    assert library_names(tmp_path) == []  # ...but is not shown until part 2 is verified too

    path = download_model(choice, listing.commit)
    assert path.name == "Split-Coder-Q8_0-00001-of-00002.gguf" and path.parent.name == "Q8_0"
    assert library_names(tmp_path) == ["Split-Coder-Q8_0-00001-of-00002"]  # one model, not two
    assert await run_self_test(path, llama_server=llama_server_binary) == 0


# --- the queue ------------------------------------------------------------------------------


class Recorder:
    """Collects what the queue reports, and lets a test wait for a condition on it."""

    def __init__(self) -> None:
        self.events: list[DownloadProgress] = []
        self._changed = threading.Condition()

    def __call__(self, progress: DownloadProgress) -> None:
        with self._changed:
            self.events.append(progress)
            self._changed.notify_all()

    def wait_for(self, predicate, timeout: float = 30.0) -> DownloadProgress:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in reversed(self.events):
                    if predicate(event):
                        return event
                left = deadline - time.monotonic()
                assert left > 0, f"not reported within {timeout} s: {self.events[-3:]}"
                self._changed.wait(left)


def test_the_queue_runs_downloads_one_at_a_time_and_reports_progress(hf_hub, tmp_path):
    listing = list_repo(CODER_REPO)
    queue = DownloadQueue(tmp_path / "downloads.json")
    seen = Recorder()
    queue.add_listener(seen)
    try:
        first = queue.add(pick_choice(listing, "Q4_K_M"), listing.commit)
        second = queue.add(pick_choice(listing, "Q8_0"), listing.commit)
        done_second = seen.wait_for(lambda p: p.job_id == second and p.state == DownloadState.DONE)
        assert Path(done_second.path).is_file()
        states = [(p.job_id, p.state) for p in seen.events]
        # The second waited while the first ran.
        assert states.index((first, DownloadState.DONE)) < states.index((second, DownloadState.DOWNLOADING))
        moving = [p for p in seen.events if p.job_id == first and p.state == DownloadState.DOWNLOADING]
        assert moving[-1].done_bytes > moving[0].done_bytes
        assert any(p.state == DownloadState.VERIFYING for p in seen.events)
    finally:
        queue.close()
    assert library_names(tmp_path) == ["Tiny-Coder-Q4_K_M", "Tiny-Coder-Q8_0"]


def test_a_queued_download_survives_a_restart_paused_and_resumes(hf_hub, tmp_path):
    listing = list_repo(CODER_REPO)
    choice = pick_choice(listing, "Q4_K_M")
    state = tmp_path / "downloads.json"
    hf_hub.hold(after=2 * MiB)  # the endpoint stops sending here until released
    queue = DownloadQueue(state)
    seen = Recorder()
    queue.add_listener(seen)
    job = queue.add(choice, listing.commit)
    seen.wait_for(lambda p: p.state == DownloadState.DOWNLOADING and p.done_bytes >= 2 * MiB)
    assert hf_hub.holding.is_set()
    closing = threading.Thread(target=queue.close)  # the app quits mid-download
    closing.start()
    hf_hub.release()
    closing.join(30)
    assert not closing.is_alive()
    kept = bytes_on_disk(choice, listing.commit)
    assert 0 < kept < choice.size

    # Next start: the download is listed, paused, and nothing was fetched on its own.
    served_before = len(hf_hub.served)
    queue = DownloadQueue(state)
    seen = Recorder()
    queue.add_listener(seen)
    try:
        [paused] = queue.jobs()
        assert (paused.job_id, paused.state, paused.done_bytes) == (job, DownloadState.PAUSED, kept)
        assert len(hf_hub.served) == served_before
        queue.resume(job)
        done = seen.wait_for(lambda p: p.state == DownloadState.DONE)
        assert Path(done.path).is_file()
    finally:
        queue.close()
    resumed = hf_hub.served[-1]
    assert (resumed.start, resumed.sent) == (kept, choice.size - kept)


def test_cancel_in_the_queue_removes_the_partial_file(hf_hub, tmp_path):
    listing = list_repo(CODER_REPO)
    choice = pick_choice(listing, "Q4_K_M")
    hf_hub.hold(after=2 * MiB)
    queue = DownloadQueue(tmp_path / "downloads.json")
    seen = Recorder()
    queue.add_listener(seen)
    try:
        job = queue.add(choice, listing.commit)
        seen.wait_for(lambda p: p.state == DownloadState.DOWNLOADING and p.done_bytes >= 2 * MiB)
        queue.cancel(job)
        hf_hub.release()
        seen.wait_for(lambda p: p.state == DownloadState.CANCELLED)
    finally:
        queue.close()
    assert bytes_on_disk(choice, listing.commit) == 0
    assert queue.jobs()[0].state == DownloadState.CANCELLED
    assert DownloadQueue(tmp_path / "downloads.json").jobs() == []  # not remembered
