"""Downloading a model into the standard Hugging Face cache: resumable, verified, queued.

huggingface_hub speaks the protocol (HEAD for the file's location and ETag, auth headers,
ranged GETs, retries of a dropped connection); this module decides where bytes go.  The
library's own `hf_hub_download` is not used because since 2.x it writes to a temporary
name unique to the process and deletes it on any failure, so a download could not
be paused, nor survive a restart.  Here the bytes go to `blobs/<sha256>.incomplete`
(the name older huggingface_hub versions used), which a later run resumes with a range
request.  A file is verified against the SHA-256 the repository publishes *before* it
becomes a blob, and a model's snapshot links (what the library and other tools see) are
made only when every part of it is verified: a half or corrupt model never appears.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import platformdirs

from backend.errors import ChecksumMismatch, DownloadFailed, HubError
from backend.models.gguf_info import format_file_size
from backend.models.hub import HubFile, ModelChoice, current_token, hub_endpoint, translate_hub_error
from backend.models.library import hugging_face_cache
from backend.settings import APP_NAME

__all__ = [
    "DownloadProgress",
    "DownloadQueue",
    "DownloadStopped",
    "Stopper",
    "TransferMeter",
    "describe_duration",
    "bytes_on_disk",
    "download_model",
    "repo_folder",
    "snapshot_path",
]

log = logging.getLogger("gguf_studio.downloads")

# huggingface_hub reads its chunk size at call time; 10 MiB chunks would make progress
# and a pause react only every 10 MiB.
CHUNK_SIZE = 1024 * 1024
STATES = ("queued", "downloading", "verifying", "paused", "done", "failed", "cancelled")


@dataclass(frozen=True)
class DownloadProgress:
    job_id: str
    repo_id: str
    name: str
    state: str  # one of STATES
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
        if self.state == "downloading" and self.speed > 0:
            text += f", {format_file_size(int(self.speed))}/s"
            if self.eta is not None:
                text += f", {describe_duration(self.eta)} left"
        elif self.state != "downloading":
            text += f" ({self.message or self.state})"
        return text


class DownloadStopped(Exception):
    """Raised inside a download when it is paused or cancelled; never shown to the user."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # "pause" or "cancel"


class Stopper:
    """Asks a running download, from any thread, to pause or cancel."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def stop(self, reason: str) -> None:
        self.reason = reason

    def check(self) -> None:
        if self.reason:
            raise DownloadStopped(self.reason)


class TransferMeter:
    """Bytes done, speed over the last few seconds, and time left at that speed."""

    def __init__(self, done: int, total: int, window: float = 3.0) -> None:
        self.done = done
        self.total = total
        self._window = window
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), done)])

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self._window:
            self._samples.popleft()

    @property
    def speed(self) -> float:
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    @property
    def eta(self) -> float | None:
        speed = self.speed
        return max(self.total - self.done, 0) / speed if speed > 0 else None


def repo_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    cache = Path(cache_dir) if cache_dir else hugging_face_cache()
    return cache / ("models--" + repo_id.replace("/", "--"))


def snapshot_path(choice: ModelChoice, commit: str, cache_dir: Path | None = None) -> Path:
    """Where the model's first file is once downloaded: the path llama-server opens."""
    return repo_folder(choice.repo_id, cache_dir) / "snapshots" / commit / choice.first_file


def bytes_on_disk(choice: ModelChoice, commit: str, cache_dir: Path | None = None) -> int:
    """How much of the model is already here, finished or resumable."""
    blobs = repo_folder(choice.repo_id, cache_dir) / "blobs"
    done = 0
    for f in choice.files:
        blob = blobs / f.sha256 if f.sha256 else None
        if blob is not None and blob.is_file():
            done += blob.stat().st_size
        elif blob is not None and (partial := _incomplete(blob)).is_file():
            done += min(partial.stat().st_size, f.size)
    return done


def download_model(choice: ModelChoice, commit: str, *, cache_dir: Path | None = None,
                   token: str | None = None, stopper: Stopper | None = None,
                   on_bytes: Callable[[int], None] = lambda n: None,
                   on_verifying: Callable[[], None] = lambda: None) -> Path:
    """Download every part of `choice` at `commit`; returns the path of its first file.

    Blocking (run it off the GUI thread).  `on_bytes` gets each chunk's size as it is
    written.  A pause leaves `.incomplete` files that the next call resumes; a cancel or
    a failed checksum removes what this model left behind.
    """
    folder = repo_folder(choice.repo_id, cache_dir)
    stopper = stopper or Stopper()
    token = token or current_token()
    try:
        blobs = [_fetch_blob(choice.repo_id, commit, f, folder, token, stopper, on_bytes, on_verifying)
                 for f in choice.files]
        for f, blob in zip(choice.files, blobs):
            _link(folder, commit, f.path, blob)
        _write_ref(folder, commit)
    except DownloadStopped as stop:
        if stop.reason == "cancel":
            discard_partial(choice, commit, cache_dir)
        raise
    except ChecksumMismatch:
        discard_partial(choice, commit, cache_dir)
        raise
    return folder / "snapshots" / commit / choice.first_file


def discard_partial(choice: ModelChoice, commit: str, cache_dir: Path | None = None) -> None:
    """Remove the model's unfinished files and any part blob no snapshot links to yet."""
    folder = repo_folder(choice.repo_id, cache_dir)
    for f in choice.files:
        if not f.sha256:
            continue
        blob = folder / "blobs" / f.sha256
        _incomplete(blob).unlink(missing_ok=True)
        if not (folder / "snapshots" / commit / f.path).exists():
            blob.unlink(missing_ok=True)


# --- the queue ---------------------------------------------------------------------------------


class DownloadQueue:
    """Several downloads, one at a time, on a worker thread; remembered across restarts.

    Listeners get a `DownloadProgress` on every state change and at most ten times a
    second while bytes flow, on the worker thread.  Jobs that were running or queued
    when the app closed come back paused: nothing touches the network until asked.
    """

    def __init__(self, state_path: Path | None = None, *, cache_dir: Path | None = None,
                 token: str | None = None, report_interval: float = 0.1) -> None:
        self.state_path = Path(state_path) if state_path else default_state_path()
        self.cache_dir = cache_dir
        self.token = token
        self.report_interval = report_interval
        self._jobs: dict[str, _Job] = {}
        self._listeners: list[Callable[[DownloadProgress], None]] = []
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closing = False
        self._load()

    def add_listener(self, fn: Callable[[DownloadProgress], None]) -> None:
        self._listeners.append(fn)

    def jobs(self) -> list[DownloadProgress]:
        with self._lock:
            return [job.progress for job in self._jobs.values()]

    def add(self, choice: ModelChoice, commit: str) -> str:
        """Queue `choice`; the same model twice is one job (resumed if it was paused)."""
        with self._lock:
            for job in self._jobs.values():
                if job.choice == choice and job.commit == commit and job.progress.state not in ("done", "cancelled"):
                    job_id = job.progress.job_id
                    break
            else:
                job_id = uuid.uuid4().hex[:12]
                done = bytes_on_disk(choice, commit, self.cache_dir)
                self._jobs[job_id] = _Job(choice, commit, DownloadProgress(
                    job_id, choice.repo_id, choice.name, "paused", done, choice.size))
        self.resume(job_id)
        return job_id

    def pause(self, job_id: str) -> None:
        self._stop(job_id, "pause")

    def cancel(self, job_id: str) -> None:
        self._stop(job_id, "cancel")

    def resume(self, job_id: str) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.progress.state not in ("paused", "failed", "cancelled"):
                return
            job.stopper = Stopper()
            self._set(job, state="queued", message="")
            self._ensure_worker()
        self._save()

    def close(self, timeout: float = 10.0) -> None:
        """Pause whatever runs (its bytes are kept) and stop the worker."""
        with self._lock:
            self._closing = True
            for job in self._jobs.values():
                job.stopper.stop("pause")
            worker = self._worker
        if worker is not None:
            worker.join(timeout)
        self._save()

    # --- worker ------------------------------------------------------------------------------

    def _stop(self, job_id: str, reason: str) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            state = job.progress.state
            if state in ("downloading", "verifying"):
                job.stopper.stop(reason)  # the worker reports the new state
            elif state == "queued" or (reason == "cancel" and state in ("paused", "failed")):
                job.stopper.stop(reason)
                if reason == "cancel":
                    discard_partial(job.choice, job.commit, self.cache_dir)
                self._set(job, state="paused" if reason == "pause" else "cancelled",
                          done_bytes=0 if reason == "cancel" else job.progress.done_bytes)
        self._save()

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="gguf-studio-downloads", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                job = next((j for j in self._jobs.values() if j.progress.state == "queued"), None)
                if job is None or self._closing:
                    self._worker = None
                    return
                self._set(job, state="downloading",
                          done_bytes=bytes_on_disk(job.choice, job.commit, self.cache_dir))
            self._run(job)
            self._save()

    def _run(self, job: _Job) -> None:
        meter = TransferMeter(job.progress.done_bytes, job.progress.total_bytes)
        last_report = 0.0
        trailing: threading.Timer | None = None

        def report_latest() -> None:
            nonlocal last_report, trailing
            with self._lock:
                trailing = None
                if job.progress.state == "downloading":
                    last_report = time.monotonic()
                    self._set(job, speed=meter.speed, eta=meter.eta)

        def on_bytes(n: int) -> None:
            nonlocal last_report, trailing
            with self._lock:
                meter.add(n)
                now = time.monotonic()
                quiet = now - last_report < self.report_interval
                if not quiet:
                    last_report = now
                elif trailing is None:
                    # When bytes stop flowing, the last of them is still reported.
                    trailing = threading.Timer(self.report_interval, report_latest)
                    trailing.daemon = True
                    trailing.start()
                self._set(job, done_bytes=meter.done, speed=meter.speed, eta=meter.eta, quiet=quiet)

        def on_verifying() -> None:
            with self._lock:
                self._set(job, state="verifying", speed=0.0, eta=None)

        try:
            path = download_model(job.choice, job.commit, cache_dir=self.cache_dir, token=self.token,
                                  stopper=job.stopper, on_bytes=on_bytes, on_verifying=on_verifying)
        except DownloadStopped as stop:
            with self._lock:
                if stop.reason == "cancel":
                    self._set(job, state="cancelled", done_bytes=0, speed=0.0, eta=None)
                else:
                    self._set(job, state="paused", speed=0.0, eta=None,
                              done_bytes=bytes_on_disk(job.choice, job.commit, self.cache_dir))
        except HubError as exc:
            self._fail(job, str(exc))
        except Exception as exc:  # a bug must not kill the worker and freeze the queue
            log.exception("download of %s failed", job.choice.name)
            self._fail(job, f"The download failed: {exc}.")
        else:
            with self._lock:
                self._set(job, state="done", done_bytes=job.progress.total_bytes, speed=0.0,
                          eta=None, path=str(path))

    def _fail(self, job: _Job, message: str) -> None:
        with self._lock:
            self._set(job, state="failed", message=message, speed=0.0, eta=None,
                      done_bytes=bytes_on_disk(job.choice, job.commit, self.cache_dir))

    def _set(self, job: _Job, *, quiet: bool = False, **changes: Any) -> None:
        # Called with the lock held; listeners must not call back into the queue.
        job.progress = replace(job.progress, **changes)
        if not quiet:
            for fn in list(self._listeners):
                try:
                    fn(job.progress)
                except Exception:
                    log.exception("download listener failed")

    # --- persistence -------------------------------------------------------------------------

    def _save(self) -> None:
        with self._lock:
            kept = [{"choice": _choice_to_dict(j.choice), "commit": j.commit,
                     "job_id": j.progress.job_id, "state": j.progress.state}
                    for j in self._jobs.values() if j.progress.state not in ("done", "cancelled")]
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"version": 1, "downloads": kept}, indent=2))
            os.replace(tmp, self.state_path)
        except OSError as exc:
            log.warning("could not remember the downloads: %s", exc)

    def _load(self) -> None:
        try:
            data = json.loads(self.state_path.read_text())
            entries = data["downloads"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        for entry in entries:
            try:
                choice = _choice_from_dict(entry["choice"])
                commit, job_id = str(entry["commit"]), str(entry["job_id"])
            except (KeyError, TypeError, ValueError):
                continue
            state = "failed" if entry.get("state") == "failed" else "paused"
            done = bytes_on_disk(choice, commit, self.cache_dir)
            self._jobs[job_id] = _Job(choice, commit, DownloadProgress(
                job_id, choice.repo_id, choice.name, state, done, choice.size))


def default_state_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "downloads.json"


# --- one file ------------------------------------------------------------------------------


class _Job:
    def __init__(self, choice: ModelChoice, commit: str, progress: DownloadProgress) -> None:
        self.choice = choice
        self.commit = commit
        self.progress = progress
        self.stopper = Stopper()


class _Sink:
    """The file huggingface_hub writes into: counts and hashes bytes, stops between chunks.

    Hashing as the bytes arrive spares reading the whole file again to verify it (a
    20 GB model would spend some 20 s on that); a resumed file hashes only its kept part.
    """

    def __init__(self, file: Any, stopper: Stopper, on_bytes: Callable[[int], None],
                 digest: Any) -> None:
        self._file = file
        self._stopper = stopper
        self._on_bytes = on_bytes
        self.digest = digest

    def write(self, data: bytes) -> int:
        # Written first, then stopped: a paused download keeps every byte it was sent.
        n = self._file.write(data)
        self.digest.update(data)
        self._on_bytes(len(data))
        self._stopper.check()
        return int(n)

    def truncate(self, size: int | None = None) -> int:
        # huggingface_hub starts over when a server ignores the range: hash what is left.
        kept = int(self._file.truncate(size))
        self._file.flush()
        self.digest = _sha256_of(Path(self._file.name), kept, self._stopper)
        return kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _fetch_blob(repo_id: str, commit: str, f: HubFile, folder: Path, token: str | None,
                stopper: Stopper, on_bytes: Callable[[int], None],
                on_verifying: Callable[[], None]) -> Path:
    from filelock import FileLock
    from huggingface_hub import constants
    # Modules named in full: the lazy top-level names hide them from PyInstaller.
    from huggingface_hub.file_download import get_hf_file_metadata, hf_hub_url, http_get
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils._headers import build_hf_headers
    from huggingface_hub.utils.tqdm import silent_tqdm

    stopper.check()
    blobs = folder / "blobs"
    if f.sha256 and (blobs / f.sha256).is_file():
        return blobs / f.sha256
    url = hf_hub_url(repo_id, f.path, revision=commit, endpoint=hub_endpoint())
    try:
        meta = get_hf_file_metadata(url, token=token)
    except Exception as exc:
        raise translate_hub_error(exc, repo_id) from exc
    name = f.sha256 or meta.etag
    if not name:
        raise HubError(f"Hugging Face did not identify {f.path}; try again later.")
    size = meta.size if meta.size is not None else f.size
    blob = blobs / name
    if blob.is_file():
        return blob
    lock = Path(str(blob) + ".lock")
    try:
        blobs.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock)):
            partial = _incomplete(blob)
            have = partial.stat().st_size if partial.is_file() else 0
            if have > size:
                partial.unlink()
                have = 0
            free = shutil.disk_usage(blobs).free
            if free < size - have:
                raise DownloadFailed(f"Not enough disk space for {f.path.rsplit('/', 1)[-1]}: "
                                     f"{format_file_size(size - have)} needed, {format_file_size(free)} free.")
            digest = _sha256_of(partial, have, stopper)
            if have < size:
                constants.DOWNLOAD_CHUNK_SIZE = CHUNK_SIZE
                headers = build_hf_headers(token=token)
                with open(partial, "ab") as out:
                    sink = _Sink(out, stopper, on_bytes, digest)
                    try:
                        http_get(meta.location, sink, resume_size=have,  # type: ignore[arg-type]
                                 headers=headers, expected_size=size, tqdm_class=silent_tqdm)
                    except HfHubHTTPError as exc:  # an OSError too, but the hub's answer
                        raise translate_hub_error(exc, repo_id) from exc
                    except (DownloadStopped, DownloadFailed, OSError):
                        raise
                    except Exception as exc:
                        raise translate_hub_error(exc, repo_id) from exc
                digest = sink.digest
            on_verifying()
            if f.sha256:
                if digest.hexdigest() != f.sha256.lower():
                    partial.unlink(missing_ok=True)
                    raise ChecksumMismatch(
                        f"{f.path.rsplit('/', 1)[-1]} from {repo_id} does not match the SHA-256 the "
                        "repository publishes; the download was discarded. Try again later.")
            os.chmod(partial, 0o644)
            os.replace(partial, blob)
    except OSError as exc:
        raise _disk_error(exc, f) from exc
    finally:
        lock.unlink(missing_ok=True)
    return blob


def _link(folder: Path, commit: str, path_in_repo: str, blob: Path) -> None:
    pointer = folder / "snapshots" / commit / path_in_repo
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.exists():
        return
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:
        shutil.copyfile(blob, pointer)  # no symlinks (Windows without developer mode)


def _write_ref(folder: Path, commit: str) -> None:
    refs = folder / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    if not (refs / "main").exists():
        (refs / "main").write_text(commit)


def _incomplete(blob: Path) -> Path:
    return blob.with_name(blob.name + ".incomplete")


def _sha256_of(path: Path, length: int, stopper: Stopper) -> Any:
    """A running SHA-256 of the first `length` bytes of `path` (none: an empty one)."""
    digest = hashlib.sha256()
    if length <= 0:
        return digest
    with open(path, "rb") as f:
        left = length
        while left and (chunk := f.read(min(4 * 1024 * 1024, left))):
            digest.update(chunk)
            left -= len(chunk)
            if stopper.reason == "cancel":
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


def describe_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _choice_to_dict(choice: ModelChoice) -> dict[str, Any]:
    return {"repo_id": choice.repo_id, "name": choice.name, "quant": choice.quant,
            "files": [asdict(f) for f in choice.files]}


def _choice_from_dict(data: dict[str, Any]) -> ModelChoice:
    return ModelChoice(str(data["repo_id"]), str(data["name"]), str(data.get("quant", "")),
                       tuple(HubFile(str(f["path"]), int(f["size"]), str(f.get("sha256", "")))
                             for f in data["files"]))
