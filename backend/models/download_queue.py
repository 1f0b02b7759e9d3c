"""The downloads the window queues: several models, one at a time, on a worker thread,
remembered across restarts.  One download is `backend.models.download.ModelDownload`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import platformdirs

from backend.errors import HubError, UnsafeHubAnswer
from backend.listeners import Listeners
from backend.models.download import (DownloadProgress, DownloadState, DownloadStopped,
                                     ModelDownload, StopReason, Stopper)
from backend.models.hf_cache import printable
from backend.models.hub import HubFile, ModelChoice
from backend.models.transfer_meter import TransferMeter
from backend.private_files import PRIVATE_DIR_MODE
from backend.settings import APP_NAME
from backend.throttle import Throttle

__all__ = ["DownloadQueue", "default_state_path"]

log = logging.getLogger("gguf_studio.downloads")


class DownloadQueue:
    """Several downloads, one at a time, on a worker thread; remembered across restarts.

    Listeners get a `DownloadProgress` on every state change and, through a `Throttle`,
    at most ten times a second while bytes flow (the last bytes always reported), on the
    worker or a timer thread.  Jobs that were running or queued when the app closed come
    back paused: nothing touches the network until asked.
    """

    def __init__(self, state_path: Path | None = None, *, cache_dir: Path | None = None,
                 token: str | None = None, report_interval: float = 0.1) -> None:
        self.state_path = Path(state_path) if state_path else default_state_path()
        self.cache_dir = cache_dir
        self.token = token
        self.report_interval = report_interval
        self._jobs: dict[str, _Job] = {}
        self._listeners: Listeners[[DownloadProgress]] = Listeners(log, "download listener")
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closing = False
        self._load()

    def add_listener(self, fn: Callable[[DownloadProgress], None]) -> None:
        self._listeners.add(fn)

    def jobs(self) -> list[DownloadProgress]:
        with self._lock:
            return [job.progress for job in self._jobs.values()]

    def add(self, choice: ModelChoice, commit: str) -> str:
        """Queue `choice`; the same model twice is one job (resumed if it was paused)."""
        with self._lock:
            for job in self._jobs.values():
                if job.choice == choice and job.commit == commit and not job.progress.state.finished:
                    job_id = job.progress.job_id
                    break
            else:
                job_id = uuid.uuid4().hex[:12]
                download = ModelDownload(choice, commit, cache_dir=self.cache_dir, token=self.token)
                self._jobs[job_id] = _Job(choice, commit, DownloadProgress(
                    job_id, choice.repo_id, choice.name, DownloadState.PAUSED, download.bytes_on_disk(), choice.size),
                    download)
        self.resume(job_id)
        return job_id

    def pause(self, job_id: str) -> None:
        self._stop(job_id, StopReason.PAUSE)

    def cancel(self, job_id: str) -> None:
        self._stop(job_id, StopReason.CANCEL)

    def resume(self, job_id: str) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or not job.progress.state.resumable:
                return
            job.stopper = Stopper()
            self._set(job, state=DownloadState.QUEUED, message="")
            self._ensure_worker()
        self._save()

    def close(self, timeout: float = 10.0) -> None:
        """Pause whatever runs (its bytes are kept) and stop the worker."""
        with self._lock:
            self._closing = True
            for job in self._jobs.values():
                job.stopper.stop(StopReason.PAUSE)
            worker = self._worker
        if worker is not None:
            worker.join(timeout)
        self._save()

    # --- worker ------------------------------------------------------------------------------

    def _stop(self, job_id: str, reason: StopReason) -> None:
        cancel = reason is StopReason.CANCEL
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            state = job.progress.state
            if state in (DownloadState.DOWNLOADING, DownloadState.VERIFYING):
                job.stopper.stop(reason)  # the worker reports the new state
            elif state is DownloadState.QUEUED or (cancel and state in (DownloadState.PAUSED, DownloadState.FAILED)):
                job.stopper.stop(reason)
                if cancel and job.download is not None:
                    job.download.discard()
                self._set(job, state=DownloadState.CANCELLED if cancel else DownloadState.PAUSED,
                          done_bytes=0 if cancel else job.progress.done_bytes)
        self._save()

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="gguf-studio-downloads", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                job = next((j for j in self._jobs.values() if j.progress.state is DownloadState.QUEUED), None)
                if job is None or self._closing:
                    self._worker = None
                    return
                self._set(job, state=DownloadState.DOWNLOADING, done_bytes=job.bytes_on_disk())
            self._run(job)
            self._save()

    def _run(self, job: _Job) -> None:
        meter = TransferMeter(job.progress.done_bytes, job.progress.total_bytes)

        def report_latest() -> None:
            with self._lock:
                if job.progress.state is DownloadState.DOWNLOADING:  # not after it ended
                    self._set(job, done_bytes=meter.done, speed=meter.speed, eta=meter.eta)

        reports = Throttle(self.report_interval, report_latest)

        def on_bytes(n: int) -> None:
            with self._lock:
                meter.add(n)
                if job.progress.state is DownloadState.VERIFYING:  # the next part's bytes
                    self._set(job, state=DownloadState.DOWNLOADING, done_bytes=meter.done)
            reports.poke()

        def on_verifying() -> None:
            with self._lock:
                self._set(job, state=DownloadState.VERIFYING, done_bytes=meter.done, speed=0.0, eta=None)

        try:
            if job.download is None:
                raise UnsafeHubAnswer(job.refusal)
            path = job.download.run(job.stopper, on_bytes, on_verifying)
        except DownloadStopped as stop:
            with self._lock:
                if stop.reason is StopReason.CANCEL:
                    self._set(job, state=DownloadState.CANCELLED, done_bytes=0, speed=0.0, eta=None)
                else:
                    self._set(job, state=DownloadState.PAUSED, speed=0.0, eta=None, done_bytes=job.bytes_on_disk())
        except HubError as exc:
            self._fail(job, str(exc))
        except Exception as exc:  # a bug must not kill the worker and freeze the queue
            log.exception("download of %s failed", job.choice.name)
            self._fail(job, f"The download failed: {exc}.")
        else:
            with self._lock:
                self._set(job, state=DownloadState.DONE, done_bytes=job.progress.total_bytes, speed=0.0,
                          eta=None, path=str(path))

    def _fail(self, job: _Job, message: str) -> None:
        with self._lock:
            self._set(job, state=DownloadState.FAILED, message=message, speed=0.0, eta=None,
                      done_bytes=job.bytes_on_disk())

    def _set(self, job: _Job, **changes: Any) -> None:
        # Called with the lock held; listeners must not call back into the queue.
        job.progress = replace(job.progress, **changes)
        self._listeners(job.progress)

    # --- persistence -------------------------------------------------------------------------

    def _save(self) -> None:
        with self._lock:
            kept = [{"choice": _choice_to_dict(j.choice), "commit": j.commit,
                     "job_id": j.progress.job_id, "state": j.progress.state.value,
                     "created": j.download.created() if j.download is not None else []}
                    for j in self._jobs.values() if not j.progress.state.finished]
        try:
            self.state_path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
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
        for entry in entries if isinstance(entries, list) else []:
            try:
                choice = _choice_from_dict(entry["choice"])
                commit, job_id = str(entry["commit"]), str(entry["job_id"])
                created = [str(blob_id) for blob_id in entry.get("created", [])]
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            failed = entry.get("state") == DownloadState.FAILED.value
            state = DownloadState.FAILED if failed else DownloadState.PAUSED
            # The saved record is checked as a hub's answer is: it may have come from one
            # before these checks existed, or been edited.  A refused one stays listed,
            # failed with the reason, so the person sees it and can remove it.
            try:
                download: ModelDownload | None = ModelDownload(
                    choice, commit, cache_dir=self.cache_dir, token=self.token, created=created)
                refusal = ""
            except UnsafeHubAnswer as exc:
                download, refusal, state = None, str(exc), DownloadState.FAILED
            job = _Job(choice, commit, DownloadProgress(
                job_id, printable(choice.repo_id, 100), printable(choice.name, 100), state, 0, choice.size,
                message=refusal), download, refusal)
            job.progress = replace(job.progress, done_bytes=job.bytes_on_disk())
            self._jobs[job_id] = job


def default_state_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "downloads.json"




# --- the queue's parts -----------------------------------------------------------------------


class _Job:
    def __init__(self, choice: ModelChoice, commit: str, progress: DownloadProgress,
                 download: ModelDownload | None, refusal: str = "") -> None:
        self.choice = choice
        self.commit = commit
        self.progress = progress
        self.download = download  # None when the saved record was refused (see `refusal`)
        self.refusal = refusal
        self.stopper = Stopper()

    def bytes_on_disk(self) -> int:
        return self.download.bytes_on_disk() if self.download is not None else 0


def _choice_to_dict(choice: ModelChoice) -> dict[str, Any]:
    return {"repo_id": choice.repo_id, "name": choice.name, "quant": choice.quant,
            "files": [asdict(f) for f in choice.files]}


def _choice_from_dict(data: dict[str, Any]) -> ModelChoice:
    return ModelChoice(str(data["repo_id"]), str(data["name"]), str(data.get("quant", "")),
                       tuple(HubFile(str(f["path"]), int(f["size"]), str(f.get("sha256", "")))
                             for f in data["files"]))
