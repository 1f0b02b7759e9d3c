"""Downloading a model into the standard Hugging Face cache: resumable and verified (the
window's queue of downloads is `backend.models.download_queue`).

huggingface_hub speaks the protocol (HEAD for the file's location and ETag, auth headers,
ranged GETs, retries of a dropped connection); this module decides where bytes go.  The
library's own `hf_hub_download` is not used because since 2.x it writes to a temporary
name unique to the process and deletes it on any failure, so a download could not
be paused, nor survive a restart.  Here the bytes go to `blobs/<sha256>.incomplete`
(the name older huggingface_hub versions used), which a later run resumes with a range
request.  A file is verified against the SHA-256 the repository publishes (a file kept
in git, against its git blob id) *before* it becomes a blob, and a model's snapshot links
(what the library and other tools see) are made only when every part of it is verified:
a half or corrupt model never appears.

What the hub answers is input, not truth (`backend.models.hf_cache` checks every value that
becomes a path): no byte is written past the size it announced, a cancel removes only
what this download made, and the token goes only to the endpoint itself.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import urljoin

from backend.errors import ChecksumMismatch, DownloadFailed, HubError, UnsafeHubAnswer, WrongSize
from backend.models.gguf_info import format_file_size
from backend.models.hf_cache import GIT_BLOB_ID, RepoCache, check_blob_id, check_commit, printable, repo_cache
from backend.models.hub import (
    HubFile,
    ModelChoice,
    auth_headers,
    check_choice,
    hub_endpoint,
    is_on_endpoint,
    translate_hub_error,
)
from backend.models.transfer_meter import describe_duration

__all__ = [
    "DownloadProgress",
    "DownloadState",
    "DownloadStopped",
    "ModelDownload",
    "StopReason",
    "Stopper",
    "bytes_on_disk",
    "download_model",
    "repo_folder",
    "snapshot_path",
]

log = logging.getLogger("gguf_studio.downloads")

# huggingface_hub reads its chunk size at call time; 10 MiB chunks would make progress
# and a pause react only every 10 MiB.
CHUNK_SIZE = 1024 * 1024
MAX_REDIRECTS = 10
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DownloadState(enum.Enum):
    QUEUED = "queued"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        """Running or about to: its bytes are moving, or will without being asked."""
        return self in (DownloadState.QUEUED, DownloadState.DOWNLOADING, DownloadState.VERIFYING)

    @property
    def resumable(self) -> bool:
        return self in (DownloadState.PAUSED, DownloadState.FAILED, DownloadState.CANCELLED)

    @property
    def finished(self) -> bool:
        """Nothing more will happen to it, and it is not remembered across restarts."""
        return self in (DownloadState.DONE, DownloadState.CANCELLED)


class StopReason(enum.Enum):
    PAUSE = "pause"  # keep the bytes, resume later
    CANCEL = "cancel"  # remove what the download made


@dataclass(frozen=True)
class DownloadProgress:
    job_id: str
    repo_id: str
    name: str
    state: DownloadState
    done_bytes: int
    total_bytes: int
    speed: float = 0.0  # bytes per second over the last few seconds
    eta: float | None = None  # seconds left at that speed
    message: str = ""  # why it failed; "" otherwise
    path: str = ""  # the loadable file once done

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0

    def describe(self) -> str:
        """"1.2 GiB of 4.4 GiB, 35.0 MiB/s, 1 min 33 s left" and the like."""
        text = f"{format_file_size(self.done_bytes)} of {format_file_size(self.total_bytes)}"
        if self.state is DownloadState.DOWNLOADING and self.speed > 0:
            text += f", {format_file_size(int(self.speed))}/s"
            if self.eta is not None:
                text += f", {describe_duration(self.eta)} left"
        elif self.state is not DownloadState.DOWNLOADING:
            text += f" ({self.message or self.state.value})"
        return text


class DownloadStopped(Exception):
    """Raised inside a download when it is paused or cancelled; never shown to the user."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class Stopper:
    """Asks a running download, from any thread, to pause or cancel."""

    def __init__(self) -> None:
        self.reason: StopReason | None = None

    def stop(self, reason: StopReason) -> None:
        self.reason = reason

    def check(self) -> None:
        if self.reason:
            raise DownloadStopped(self.reason)


def repo_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    return repo_cache(repo_id, cache_dir).folder


def snapshot_path(choice: ModelChoice, commit: str, cache_dir: Path | None = None) -> Path:
    """Where the model's first file is once downloaded: the path llama-server opens."""
    return repo_cache(choice.repo_id, cache_dir).pointer(commit, choice.first_file)


def bytes_on_disk(choice: ModelChoice, commit: str, cache_dir: Path | None = None) -> int:
    """How much of the model is already here, finished or resumable."""
    return ModelDownload(choice, commit, cache_dir=cache_dir).bytes_on_disk()


def download_model(choice: ModelChoice, commit: str, *, cache_dir: Path | None = None,
                   token: str | None = None, stopper: Stopper | None = None,
                   on_bytes: Callable[[int], None] = lambda n: None,
                   on_verifying: Callable[[], None] = lambda: None) -> Path:
    """Download every part of `choice` at `commit`; returns the path of its first file.

    Blocking (run it off the GUI thread).  `on_bytes` gets each chunk's size as it is
    written.  A pause leaves `.incomplete` files that the next call resumes; a cancel or
    a failed checksum removes what this download left behind.
    """
    return ModelDownload(choice, commit, cache_dir=cache_dir, token=token).run(
        stopper or Stopper(), on_bytes, on_verifying)


class ModelDownload:
    """One model at one commit: each part fetched and verified into its blob, then linked.

    Everything the hub said about it (repository, commit, file names, checksums) is
    checked when it is made, so nothing unchecked ever becomes a path.  `created` names
    the blobs whose bytes this download wrote, also before a pause when the queue hands
    them back: `discard` removes only those, and never one that a snapshot links to.
    """

    def __init__(self, choice: ModelChoice, commit: str, *, cache_dir: Path | None = None,
                 token: str | None = None, created: Iterable[str] = ()) -> None:
        self.choice = check_choice(choice)
        self.commit = check_commit(commit)
        self.cache = repo_cache(choice.repo_id, cache_dir)
        for f in choice.files:
            self.cache.pointer(commit, f.path)
        self.token = token
        self._created = {check_blob_id(blob_id) for blob_id in created}
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.cache.pointer(self.commit, self.choice.first_file)

    def created(self) -> list[str]:
        with self._lock:
            return sorted(self._created)

    def bytes_on_disk(self) -> int:
        done = 0
        for f in self.choice.files:
            if not f.sha256:
                continue
            blob = self.cache.blob(f.sha256)
            if blob.is_file():
                done += blob.stat().st_size
            elif (partial := self.cache.incomplete(f.sha256)).is_file():
                done += min(partial.stat().st_size, f.size)
        return done

    def run(self, stopper: Stopper, on_bytes: Callable[[int], None],
            on_verifying: Callable[[], None]) -> Path:
        try:
            blobs = [self._fetch(f, stopper, on_bytes, on_verifying) for f in self.choice.files]
            for f, blob in zip(self.choice.files, blobs):
                try:
                    _link(self.cache, self.commit, f.path, blob)
                except OSError as exc:
                    raise _disk_error(exc, f) from exc
            try:
                _write_ref(self.cache.ref(), self.commit)
            except OSError as exc:
                raise _disk_error(exc, self.choice.files[0]) from exc
        except DownloadStopped as stop:
            if stop.reason is StopReason.CANCEL:
                self.discard()
            raise
        except (ChecksumMismatch, WrongSize):
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        """Remove this download's unfinished files, and the blobs it finished that no
        snapshot links to.  A blob another fetch is busy with is left alone."""
        from filelock import FileLock, Timeout

        linked = self.cache.linked_blobs()
        for blob_id in self.created():
            lock = self.cache.lock(blob_id)
            try:
                lock.parent.mkdir(parents=True, exist_ok=True)
                with FileLock(str(lock), timeout=0):
                    self.cache.incomplete(blob_id).unlink(missing_ok=True)
                    blob = self.cache.blob(blob_id)
                    if blob_id not in linked and _only_name_of(blob):
                        blob.unlink(missing_ok=True)
            except Timeout:
                continue
            except OSError as exc:
                log.warning("could not remove an unfinished download: %s", exc)
                continue
            with self._lock:
                self._created.discard(blob_id)

    # --- one part, in steps ----------------------------------------------------------------

    def _fetch(self, f: HubFile, stopper: Stopper, on_bytes: Callable[[int], None],
               on_verifying: Callable[[], None]) -> Path:
        from filelock import FileLock

        stopper.check()
        if f.sha256 and (blob := self.cache.blob(f.sha256)).is_file():
            return blob
        remote = _locate(self.choice.repo_id, self.commit, f, self.token)
        blob = self.cache.blob(remote.blob_id)
        if blob.is_file():
            return blob
        lock = self.cache.lock(remote.blob_id)
        try:
            self.cache.blobs.mkdir(parents=True, exist_ok=True)
            lock.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(lock)):
                if blob.is_file():  # another process finished it while this one waited
                    return blob
                with self._lock:
                    self._created.add(remote.blob_id)
                partial = self.cache.incomplete(remote.blob_id)
                have = _kept_bytes(partial, remote.size)
                _ensure_room(self.cache.blobs, remote.size - have, f)
                digest = _digest_of(partial, have, stopper, remote.new_digest)
                try:
                    if have < remote.size:
                        digest = _transfer(remote, partial, have, digest, stopper, on_bytes, self.token)
                    on_verifying()
                    _verify(remote, digest, self.choice.repo_id)
                except (WrongSize, ChecksumMismatch):
                    partial.unlink(missing_ok=True)
                    raise
                os.chmod(partial, 0o644)
                os.replace(partial, blob)
        except OSError as exc:
            raise _disk_error(exc, f) from exc
        return blob


# --- one file, in steps: locate, make room, transfer, verify, link ---------------------------


@dataclass(frozen=True)
class _Remote:
    """One file as the hub's answer and the listing pin it: where its bytes are, the blob
    they become, how many there are, and the digest they must have."""

    file: HubFile
    url: str
    blob_id: str
    size: int
    lfs: bool  # False: a file kept in git, verified by its git blob id

    def new_digest(self) -> Any:
        if self.lfs:
            return hashlib.sha256()
        digest = hashlib.sha1()  # git's blob id: SHA-1 of "blob <size>\0" and the bytes
        digest.update(b"blob %d\0" % self.size)
        return digest

    @property
    def name(self) -> str:
        return self.file.path.rsplit("/", 1)[-1]


def _locate(repo_id: str, commit: str, f: HubFile, token: str | None) -> _Remote:
    """Ask the hub (HEAD) where the file's bytes are, and check what it says against the listing."""
    from huggingface_hub.file_download import hf_hub_url

    url = hf_hub_url(repo_id, f.path, revision=commit, endpoint=hub_endpoint())
    try:
        response = _head(url, token)
    except HubError:
        raise
    except Exception as exc:
        raise translate_hub_error(exc, repo_id) from exc
    name = f.path.rsplit("/", 1)[-1]
    redirected = response.has_redirect_location
    announced = response.headers.get("X-Linked-Size") or \
        (None if redirected else response.headers.get("Content-Length"))
    if announced is not None and announced.strip() != str(f.size):
        raise WrongSize(f"Hugging Face announced two different sizes for {printable(name)}; "
                        "refused, nothing was written. Try again later.")
    location = urljoin(str(response.url), response.headers["Location"]) if redirected else str(response.url)
    if f.sha256:
        return _Remote(f, location, f.sha256, f.size, lfs=True)
    etag = (response.headers.get("X-Linked-Etag") or response.headers.get("ETag") or "").strip()
    etag = etag.removeprefix("W/").strip('"')
    if not GIT_BLOB_ID.fullmatch(etag):
        raise UnsafeHubAnswer(f"Hugging Face did not identify {printable(name)} by a git blob id "
                              f"(it said “{printable(etag, 80)}”), and a file outside LFS is taken only "
                              "with one; refused, nothing was written.")
    return _Remote(f, location, etag, f.size, lfs=False)


def _head(url: str, token: str | None) -> Any:
    """HEAD of a file, following redirects only on the endpoint: the answer that points
    elsewhere (a CDN) carries the file's metadata itself, and the token stays behind."""
    from huggingface_hub import constants
    from huggingface_hub.utils._headers import build_hf_headers
    from huggingface_hub.utils._http import get_session, hf_raise_for_status

    for _ in range(MAX_REDIRECTS):
        headers = {**build_hf_headers(token=False), **auth_headers(url, token), "Accept-Encoding": "identity"}
        response = get_session().head(url, headers=headers, follow_redirects=False,
                                      timeout=constants.HF_HUB_ETAG_TIMEOUT)
        hf_raise_for_status(response)
        if not response.has_redirect_location:
            return response
        target = urljoin(url, response.headers["Location"])
        if not is_on_endpoint(target):
            return response
        url = target
    raise HubError("Hugging Face redirected a download in circles; try again later.")


def _kept_bytes(partial: Path, size: int) -> int:
    have = partial.stat().st_size if partial.is_file() else 0
    if have > size:  # not the bytes of this file: start over
        partial.unlink()
        return 0
    return have


def _ensure_room(folder: Path, needed: int, f: HubFile) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise DownloadFailed(f"Not enough disk space for {f.path.rsplit('/', 1)[-1]}: "
                             f"{format_file_size(needed)} needed, {format_file_size(free)} free.")


def _transfer(remote: _Remote, partial: Path, have: int, digest: Any, stopper: Stopper,
              on_bytes: Callable[[int], None], token: str | None) -> Any:
    """Append the missing bytes to `partial`; returns the digest of the whole file."""
    from huggingface_hub import constants
    # Modules named in full: the lazy top-level names hide them from PyInstaller.
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils._headers import build_hf_headers
    from huggingface_hub.utils.tqdm import silent_tqdm

    constants.DOWNLOAD_CHUNK_SIZE = CHUNK_SIZE
    headers = {**build_hf_headers(token=False), **auth_headers(remote.url, token)}
    # O_NOFOLLOW: a link left where the unfinished file goes is never written through.
    fd = os.open(partial, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644)
    with os.fdopen(fd, "ab") as out:
        sink = _Sink(out, partial, have, remote, stopper, on_bytes, digest)
        try:
            # http_get asks for a BinaryIO; the sink is one in all but name (it forwards the
            # rest to `out`), and http_get only writes, seeks, tells and truncates.
            http_get(remote.url, sink, resume_size=have,  # type: ignore[arg-type]
                     headers=headers, expected_size=remote.size, tqdm_class=silent_tqdm)
        except HfHubHTTPError as exc:  # an OSError too, but the hub's answer
            raise translate_hub_error(exc, remote.file.path) from exc
        except (DownloadStopped, HubError):
            raise
        except OSError as exc:
            if "Consistency check failed" in str(exc):
                raise WrongSize(f"{printable(remote.name)} arrived with fewer bytes than Hugging Face "
                                "announced; the download was discarded. Try again.") from exc
            raise
        except Exception as exc:
            raise translate_hub_error(exc, remote.file.path) from exc
    return sink.digest


class _Sink:
    """The file huggingface_hub writes into: counts and hashes bytes, stops between chunks,
    and refuses any byte past the size the hub announced.

    Hashing as the bytes arrive spares reading the whole file again to verify it (a
    20 GB model would spend some 20 s on that); a resumed file hashes only its kept part.
    """

    def __init__(self, file: Any, path: Path, size: int, remote: _Remote, stopper: Stopper,
                 on_bytes: Callable[[int], None], digest: Any) -> None:
        self._file = file
        self._path = path
        self._size = size
        self._remote = remote
        self._stopper = stopper
        self._on_bytes = on_bytes
        self.digest = digest

    def write(self, data: bytes) -> int:
        if self._size + len(data) > self._remote.size:
            raise WrongSize(f"{printable(self._remote.name)} is bigger than Hugging Face announced "
                            f"({format_file_size(self._remote.size)}); the download was discarded.")
        # Written first, then stopped: a paused download keeps every byte it was sent.
        n = int(self._file.write(data))
        self._size += n
        self.digest.update(data)
        self._on_bytes(len(data))
        self._stopper.check()
        return n

    def truncate(self, size: int | None = None) -> int:
        # huggingface_hub starts over when a server ignores the range: hash what is left.
        kept = int(self._file.truncate(size))
        self._file.flush()
        self._size = kept
        self.digest = _digest_of(self._path, kept, self._stopper, self._remote.new_digest)
        return kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _verify(remote: _Remote, digest: Any, repo_id: str) -> None:
    if digest.hexdigest() != remote.blob_id:
        what = "SHA-256" if remote.lfs else "git blob id"
        raise ChecksumMismatch(
            f"{printable(remote.name)} from {repo_id} does not match the {what} the repository "
            "publishes; the download was discarded. Try again later.")


def _link(cache: RepoCache, commit: str, path_in_repo: str, blob: Path) -> None:
    """Make the snapshot's entry for the file: a relative link to its blob, or a copy
    where the file system has no links.  An old link there is replaced, never written through."""
    pointer = cache.pointer(commit, path_in_repo)
    _make_folders(cache.folder, pointer.parent)
    if os.path.islink(pointer):
        if os.path.realpath(pointer) == os.path.realpath(blob):
            return
        os.unlink(pointer)  # the link itself: a stale one (its blob deleted) or another's
    elif os.path.lexists(pointer):
        return  # a copy made where links are unsupported
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError as exc:
        if not _links_unsupported(exc):
            raise
        with open(blob, "rb") as source, \
                os.fdopen(os.open(pointer, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644), "wb") as copy:
            shutil.copyfileobj(source, copy, 4 * 1024 * 1024)


def _make_folders(base: Path, folder: Path) -> None:
    """`folder` and the folders on the way from `base`, none of them through a link."""
    current = base
    for part in folder.relative_to(base).parts:
        current = current / part
        if os.path.islink(current):
            raise UnsafeHubAnswer(f"“{printable(part)}” in the Hugging Face cache is a link to "
                                  "elsewhere; refused, nothing was written through it.")
        current.mkdir(exist_ok=True)


def _links_unsupported(exc: OSError) -> bool:
    # FAT and exFAT say EPERM; Windows without developer mode says "privilege not held".
    return exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS) \
        or getattr(exc, "winerror", None) == 1314


def _write_ref(ref: Path, commit: str) -> None:
    ref.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(ref, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    except FileExistsError:
        return  # refs/main names the newest commit some tool saw; not this one's to change
    with os.fdopen(fd, "w") as f:
        f.write(commit)


def _only_name_of(blob: Path) -> bool:
    """False when another tool hard-linked the blob elsewhere."""
    try:
        return os.lstat(blob).st_nlink <= 1
    except FileNotFoundError:
        return True


def _digest_of(path: Path, length: int, stopper: Stopper, new_digest: Callable[[], Any]) -> Any:
    """A running digest of the first `length` bytes of `path` (none: an empty one)."""
    digest = new_digest()
    if length <= 0:
        return digest
    with open(path, "rb") as f:
        left = length
        while left and (chunk := f.read(min(4 * 1024 * 1024, left))):
            digest.update(chunk)
            left -= len(chunk)
            if stopper.reason is StopReason.CANCEL:
                stopper.check()
    return digest


def _disk_error(exc: OSError, f: HubFile) -> HubError:
    if isinstance(exc, HubError):
        return exc
    name = f.path.rsplit("/", 1)[-1]
    if exc.errno == errno.ENOSPC:
        return DownloadFailed(f"The disk filled up while downloading {name}; free some space and "
                              "resume (what arrived so far is kept).")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DownloadFailed(f"GGUF Studio may not write to the Hugging Face cache folder "
                              f"({exc.strerror.lower() if exc.strerror else 'permission denied'}).")
    if "Consistency check failed" in str(exc):
        return DownloadFailed(f"{name} arrived with the wrong size; try again.")
    return DownloadFailed(f"Downloading {name} failed: {exc.strerror or exc}.")
