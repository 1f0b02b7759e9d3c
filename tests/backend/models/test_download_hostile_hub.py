"""A hub that lies: each answer is refused with a sentence, and nothing outside the cache
is created, changed or deleted, nor the token sent anywhere but the endpoint.

The endpoint is the local one (tests/hf_endpoint.py) in its hostile mode; the client is
the real huggingface_hub.  Every test compares a listing of the test's whole home (HF
home, config and cache dirs, and planted victim files) before and after, leaving out only
the repository's own folder in the cache and the app's own download record.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Iterator

import pytest

from backend.errors import ChecksumMismatch, DownloadFailed, HubAccessDenied, UnsafeHubAnswer, WrongSize
from backend.models.hf_cache import repo_cache
from backend.models.download import (
    DownloadState,
    DownloadStopped,
    StopReason,
    Stopper,
    bytes_on_disk,
    download_model,
    repo_folder,
)
from backend.models.download_queue import DownloadQueue
from backend.models.hub import HubFile, ModelChoice, list_repo, pick_choice, search
from tests.backend.models.test_download import Recorder, cache_files, library_names
from tests.conftest import CODER_REPO, GATED_REPO, SPLIT_REPO
from tests.hf_endpoint import HubEndpoint, HubRepo

Q4 = "Tiny-Coder-Q4_K_M.gguf"
EVIL_REPO = "test-org/Evil-Coder-GGUF"
COMMIT = "e" * 40
MiB = 1024 * 1024


class Home:
    """The test's home: victims planted where a lying hub would aim, and a listing of
    every entry (type, mode, size, content time, link target) to compare."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.victims = [root / "victim", root / "hf-home" / "victim", root / "hf-home" / "hub" / "victim",
                        root / "config" / "autostart" / "keep.desktop"]
        for victim in self.victims:
            victim.parent.mkdir(parents=True, exist_ok=True)
            victim.write_text("mine\n")

    def listing(self, *left_out: Path) -> dict[str, tuple]:
        skip = {str(p) for p in left_out}
        found: dict[str, tuple] = {}
        for folder, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if os.path.join(folder, d) not in skip]
            for name in dirs + files:
                path = os.path.join(folder, name)
                if path in skip:
                    continue
                st = os.lstat(path)
                target = os.readlink(path) if os.path.islink(path) else ""
                # A folder's own size and time change when entries come and go: its
                # entries are compared instead.
                folder_mode = stat.S_ISDIR(st.st_mode)
                found[os.path.relpath(path, self.root)] = (
                    st.st_mode, 0 if folder_mode else st.st_size, 0 if folder_mode else st.st_mtime_ns, target)
        return found


@pytest.fixture
def home(hf_hub, tmp_path) -> Home:
    return Home(tmp_path)


def evil_repo(coder_models, **hostile) -> HubRepo:
    files = hostile.pop("files", None) or {Q4: coder_models[Q4]}
    return HubRepo(EVIL_REPO, files, **hostile)


def outside_the_repo(home: Home, repo_id: str = EVIL_REPO) -> dict[str, tuple]:
    """The listing of everything but the repository's own folder in the cache, the
    cache's lock files, and the app's own record of its downloads."""
    config = home.root / "config" / "gguf-studio"
    locks = repo_cache(repo_id).root / ".locks"
    return home.listing(repo_folder(repo_id), locks, config / "downloads.json", config / "downloads.tmp")


def unchanged_outside_the_repo(home: Home, before: dict, repo_id: str = EVIL_REPO) -> None:
    assert outside_the_repo(home, repo_id) == before
    assert all(v.read_text() == "mine\n" for v in home.victims)


def lfs_choice(path: str, sha256: str, size: int, repo_id: str = EVIL_REPO) -> ModelChoice:
    """The choice as a listing without checks (or a saved download) would have made it."""
    return ModelChoice(repo_id, "Evil", "Q4_K_M", (HubFile(path, size, sha256),))


# --- path names, commit ids, checksums ------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "../../../../x.gguf", "../../../../.bashrc.d/x.gguf", "Q4/../../../../../x.gguf", "/etc/x.gguf",
    "C:/x.gguf", "Q4\\..\\..\\x.gguf", "./x.gguf", "Q4//x.gguf", "x\x1b[2J.gguf",
])
def test_a_file_name_that_leads_out_of_the_cache_is_refused(hf_hub, home, coder_models, name):
    hf_hub.repos[EVIL_REPO] = evil_repo(coder_models, files={name: coder_models[Q4]})
    before = outside_the_repo(home)
    with pytest.raises(UnsafeHubAnswer, match="refused") as caught:
        list_repo(EVIL_REPO)
    assert "\x1b" not in str(caught.value)
    real = hf_hub.repos[EVIL_REPO]
    choice = lfs_choice(name, real.sha256(name), coder_models[Q4].stat().st_size)
    with pytest.raises(UnsafeHubAnswer, match="would lead out of the model's folder"):
        download_model(choice, real.commit)
    unchanged_outside_the_repo(home, before)
    assert hf_hub.served == []


@pytest.mark.parametrize("commit", ["../../../dir", "main", "E" * 40, "e" * 39, "e" * 40 + "/..", ""])
def test_a_commit_id_that_is_not_one_is_refused(hf_hub, home, coder_models, commit):
    hf_hub.repos[EVIL_REPO] = evil_repo(coder_models, commit=commit)
    before = outside_the_repo(home)
    with pytest.raises(UnsafeHubAnswer, match="is not one .40 hex digits.; refused"):
        list_repo(EVIL_REPO)
    real = hf_hub.repos[EVIL_REPO]
    with pytest.raises(UnsafeHubAnswer, match="commit id"):
        download_model(lfs_choice(Q4, real.sha256(Q4), coder_models[Q4].stat().st_size), commit)
    unchanged_outside_the_repo(home, before)
    assert not (repo_folder(EVIL_REPO) / "snapshots").exists()


@pytest.mark.parametrize("sha256", ["../../victim", "../../../victim", "A" * 64, "0" * 63, "0" * 64 + "/"])
def test_a_sha256_that_is_not_one_is_refused_and_deletes_nothing(hf_hub, home, coder_models, sha256):
    hf_hub.repos[EVIL_REPO] = evil_repo(coder_models, published_sha256={Q4: sha256})
    before = outside_the_repo(home)
    with pytest.raises(UnsafeHubAnswer, match="as a SHA-256, which is not one"):
        list_repo(EVIL_REPO)
    choice = lfs_choice(Q4, sha256, coder_models[Q4].stat().st_size)
    stopper = Stopper()
    stopper.stop(StopReason.CANCEL)  # a cancel removes what the download made: here, nothing at all
    for attempt in (lambda: download_model(choice, COMMIT), lambda: download_model(choice, COMMIT, stopper=stopper),
                    lambda: bytes_on_disk(choice, COMMIT)):
        with pytest.raises(UnsafeHubAnswer):
            attempt()
    unchanged_outside_the_repo(home, before)


def test_a_file_kept_in_git_is_taken_only_by_its_git_blob_id(hf_hub, home, coder_models):
    evil = evil_repo(coder_models, in_git={Q4}, etag={Q4: "../../../../config/autostart/evil.desktop"})
    hf_hub.repos[EVIL_REPO] = evil
    before = outside_the_repo(home)
    listing = list_repo(EVIL_REPO)
    [choice] = listing.choices
    assert choice.files[0].sha256 == ""  # not in LFS: the hub publishes no SHA-256
    with pytest.raises(UnsafeHubAnswer, match="git blob id") as caught:
        download_model(choice, listing.commit)
    assert "evil.desktop" in str(caught.value) and "refused" in str(caught.value)
    assert hf_hub.served == []  # refused at the HEAD, before any byte
    unchanged_outside_the_repo(home, before)
    assert not (home.root / "config" / "autostart" / "evil.desktop").exists()

    evil.etag[Q4] = "f" * 40  # a blob id, but not this file's
    with pytest.raises(ChecksumMismatch, match="does not match the git blob id"):
        download_model(choice, listing.commit)
    assert cache_files(EVIL_REPO) == []

    del evil.etag[Q4]  # the true blob id: taken, and verified against it
    path = download_model(choice, listing.commit)
    assert path.read_bytes() == coder_models[Q4].read_bytes()
    assert path.resolve().name == evil.git_blob_id(Q4)
    unchanged_outside_the_repo(home, before)


# --- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, refusal", [(8 * MiB, "bigger than Hugging Face announced"),
                                            (-MiB, "fewer bytes than Hugging Face announced")])
def test_a_transfer_longer_or_shorter_than_announced_leaves_nothing(hf_hub, home, coder_models, extra, refusal):
    hf_hub.repos[EVIL_REPO] = evil_repo(coder_models, extra_bytes={Q4: extra})
    before = outside_the_repo(home)
    listing = list_repo(EVIL_REPO)
    choice = pick_choice(listing)
    written: list[int] = []
    with pytest.raises(WrongSize, match=refusal):
        download_model(choice, listing.commit, on_bytes=written.append)
    assert sum(written) <= choice.size  # not one byte past the announced size reached the disk
    assert cache_files(EVIL_REPO) == [] and bytes_on_disk(choice, listing.commit) == 0
    unchanged_outside_the_repo(home, before)


def test_a_head_announcing_another_size_than_the_listing_is_refused(hf_hub, home, coder_models):
    evil = evil_repo(coder_models)
    hf_hub.repos[EVIL_REPO] = evil
    listing = list_repo(EVIL_REPO)
    evil.claimed_size[Q4] = 10  # the HEAD now says something else than the listing did
    with pytest.raises(WrongSize, match="two different sizes"):
        download_model(pick_choice(listing), listing.commit)
    assert hf_hub.served == [] and cache_files(EVIL_REPO) == []


# --- deleting only what this download made ------------------------------------------------


def test_cancel_keeps_a_blob_that_another_commits_snapshot_links_to(hf_hub, home):
    first = list_repo(CODER_REPO)
    old = download_model(pick_choice(first, "Q4_K_M"), first.commit)
    hf_hub.repos[CODER_REPO].commit = "c" * 40  # the repository moved on; the file did not
    second = list_repo(CODER_REPO)
    stopper = Stopper()
    stopper.stop(StopReason.CANCEL)
    with pytest.raises(DownloadStopped):
        download_model(pick_choice(second, "Q4_K_M"), second.commit, stopper=stopper)
    assert old.is_file()  # the older snapshot still opens
    assert library_names(home.root) == ["Tiny-Coder-Q4_K_M"]


def test_cancel_keeps_a_blob_another_tool_put_in_the_cache(hf_hub, home, coder_models):
    listing = list_repo(CODER_REPO)
    choice = pick_choice(listing, "Q4_K_M")
    blob = repo_cache(CODER_REPO).blob(choice.files[0].sha256)
    blob.parent.mkdir(parents=True)
    shutil.copyfile(coder_models[Q4], blob)  # as another tool left it, not yet linked
    stopper = Stopper()
    stopper.stop(StopReason.CANCEL)
    with pytest.raises(DownloadStopped):
        download_model(choice, listing.commit, stopper=stopper)
    assert blob.read_bytes() == coder_models[Q4].read_bytes()


def test_a_link_left_in_the_snapshot_is_replaced_not_written_through(hf_hub, home):
    listing = list_repo(CODER_REPO)
    pointer = repo_cache(CODER_REPO).pointer(listing.commit, Q4)
    pointer.parent.mkdir(parents=True)
    aim = home.root / "outside" / "planted.gguf"
    aim.parent.mkdir()
    os.symlink(aim, pointer)  # dangling: its target does not exist
    before = outside_the_repo(home, CODER_REPO)
    path = download_model(pick_choice(listing, "Q4_K_M"), listing.commit)
    assert path == pointer and path.resolve().parent == repo_folder(CODER_REPO) / "blobs"
    assert not aim.exists()
    unchanged_outside_the_repo(home, before, CODER_REPO)


def test_a_folder_link_in_the_snapshot_is_refused(hf_hub, home):
    listing = list_repo(SPLIT_REPO)
    snapshot = repo_cache(SPLIT_REPO).snapshot(listing.commit)
    snapshot.mkdir(parents=True)
    outside = home.root / "outside"
    outside.mkdir()
    os.symlink(outside, snapshot / "Q8_0")  # the parts' folder leads out of the cache
    with pytest.raises(UnsafeHubAnswer, match="is a link to elsewhere"):
        download_model(listing.choices[0], listing.commit)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("code, copied", [(errno.EPERM, True), (errno.EACCES, False)])
def test_a_copy_replaces_the_link_only_where_links_are_unsupported(hf_hub, home, monkeypatch, code, copied):
    # Fault injection: no file system here lacks links, so os.symlink is made to say so.
    def no_links(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    listing = list_repo(CODER_REPO)
    monkeypatch.setattr(os, "symlink", no_links)
    if copied:
        path = download_model(pick_choice(listing, "Q4_K_M"), listing.commit)
        assert path.is_file() and not path.is_symlink()
    else:
        with pytest.raises(DownloadFailed, match="may not write"):
            download_model(pick_choice(listing, "Q4_K_M"), listing.commit)
        assert not repo_cache(CODER_REPO).pointer(listing.commit, Q4).exists()


# --- the token ---------------------------------------------------------------------------------


@pytest.fixture
def cdn(hf_hub) -> Iterator[HubEndpoint]:
    """A second host that the endpoint sends downloads to, as the hub sends them to its CDN."""
    with HubEndpoint(list(hf_hub.repos.values()), host="127.0.0.2", open_to_all=True) as other:
        hf_hub.redirect_to = other
        yield other


def test_the_token_stays_with_the_endpoint_when_a_download_is_sent_elsewhere(hf_hub, cdn, home, monkeypatch):
    from huggingface_hub import constants

    # The token of Hugging Face's own login (huggingface-cli), as a user would have it
    # (huggingface_hub reads HF_HOME when imported, so its path is pointed here).
    login = home.root / "hf-home" / "token"
    login.write_text(hf_hub.repos[GATED_REPO].token)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(login))
    listing = list_repo(GATED_REPO)
    path = download_model(pick_choice(listing), listing.commit)
    assert path.is_file()
    assert cdn.served and cdn.authorized == []  # the other host sent the bytes and saw no token
    assert any("/resolve/" in r for r in hf_hub.authorized)  # the endpoint did see it


def non_loopback_address() -> str:
    from backend.addresses import lan_addresses

    found = [a for a in lan_addresses() if not a.startswith("127.")]
    if not found:
        pytest.skip("this machine has no address but loopback")
    return found[0]


def test_no_token_goes_over_plain_http_to_an_endpoint_that_is_not_this_machine(hf_hub, home, monkeypatch):
    with HubEndpoint(list(hf_hub.repos.values()), host=non_loopback_address()) as remote:
        monkeypatch.setenv("HF_ENDPOINT", remote.url)
        monkeypatch.setenv("HF_TOKEN", hf_hub.repos[GATED_REPO].token)
        assert search("tiny")
        listing = list_repo(CODER_REPO)
        assert download_model(pick_choice(listing), listing.commit).is_file()
        with pytest.raises(HubAccessDenied):
            download_model(pick_choice(list_repo(GATED_REPO)), listing.commit)
        assert remote.requests and remote.authorized == []


# --- the saved queue --------------------------------------------------------------------------


def test_a_replayed_download_record_is_refused_and_deletes_nothing(hf_hub, home, coder_models):
    size = coder_models[Q4].stat().st_size
    state = home.root / "config" / "gguf-studio" / "downloads.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    good = hf_hub.repos[CODER_REPO]
    records = [("../../../victim", Q4, good.commit), (good.sha256(Q4), "../../../../x.gguf", good.commit),
               (good.sha256(Q4), Q4, "../../../dir")]
    state.write_text(json.dumps({"version": 1, "downloads": [
        {"choice": {"repo_id": CODER_REPO, "name": "Evil", "quant": "Q4_K_M",
                    "files": [{"path": path, "size": size, "sha256": sha}]},
         "commit": commit, "job_id": f"job{i}", "state": "paused", "created": [sha]}
        for i, (sha, path, commit) in enumerate(records)]}))
    before = outside_the_repo(home, CODER_REPO)

    queue = DownloadQueue(state)
    seen = Recorder()
    queue.add_listener(seen)
    try:
        jobs = queue.jobs()
        assert [j.state for j in jobs] == [DownloadState.FAILED] * 3
        assert all("refused" in j.message for j in jobs)
        queue.resume("job0")  # resuming asks nothing of the network and refuses again
        seen.wait_for(lambda p: p.job_id == "job0" and p.state == DownloadState.FAILED)
        for job in jobs:
            queue.cancel(job.job_id)
        assert [j.state for j in queue.jobs()] == [DownloadState.CANCELLED] * 3
    finally:
        queue.close()
    assert hf_hub.requests == []
    unchanged_outside_the_repo(home, before, CODER_REPO)
    assert not repo_folder(CODER_REPO).exists()


def test_a_part_finished_before_a_restart_is_removed_by_a_cancel_after_it(hf_hub, home):
    listing = list_repo(SPLIT_REPO)
    [choice] = listing.choices
    state = home.root / "downloads.json"
    first_part, second_part = choice.files
    hf_hub.hold(after=MiB, path=second_part.path)
    queue = DownloadQueue(state)
    seen = Recorder()
    queue.add_listener(seen)
    job = queue.add(choice, listing.commit)
    # Part 1 verified, part 2 on its way (and reported as downloading again: pausable).
    seen.wait_for(lambda p: p.state is DownloadState.DOWNLOADING and p.done_bytes > first_part.size)
    assert hf_hub.holding.wait(30)
    closing = threading.Thread(target=queue.close)  # the app quits mid-download
    closing.start()
    hf_hub.release()
    closing.join(30)
    assert repo_cache(SPLIT_REPO).blob(first_part.sha256).is_file()

    queue = DownloadQueue(state)  # the next start: the record says which blobs it made
    try:
        queue.cancel(job)
    finally:
        queue.close()
    assert cache_files(SPLIT_REPO) == []
