"""The bridge's Hugging Face calls (mixed into `studio.bridge.ServiceBridge`): the curated
list, search, a repository's files with a fit badge each, downloads and the token.  They
block on the network, so they run on the bridge's hub thread, never on the window's or the
port's loop."""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from backend.llama.engine import detect_accelerators
from backend.models.download_queue import DownloadQueue
from backend.models.fit import FitEstimate, MachineMemory
from backend.models.hub import CuratedModel, ModelChoice, RepoListing, RepoSummary, curated_models

__all__ = ["HubCalls"]

Callback = Callable[[Any], None]
T = TypeVar("T")


class HubCalls:
    if TYPE_CHECKING:  # the bridge's
        _hub: concurrent.futures.ThreadPoolExecutor
        downloads: DownloadQueue

        def run_in_thread(self, fn: Callable[..., T], *args: Any,
                          on_done: Callback | None = None,
                          on_error: Callable[[str], None] | None = None
                          ) -> concurrent.futures.Future[T]: ...

        def _in_pool(self, pool: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., T],
                     *args: Any, on_done: Callback | None,
                     on_error: Callable[[str], None] | None) -> concurrent.futures.Future[T]: ...

    def curated_models(self) -> list[CuratedModel]:
        """The shipped list of good coding models; package data, no network."""
        return curated_models()

    def search_models(self, text: str, sort: str, on_done: Callback,
                      on_error: Callable[[str], None]) -> concurrent.futures.Future[list[RepoSummary]]:
        from backend.models.hub import search

        return self._in_hub(lambda: search(text, sort=sort), on_done=on_done, on_error=on_error)

    def list_repo(self, repo_id: str, context: int, on_done: Callback,
                  on_error: Callable[[str], None]
                  ) -> concurrent.futures.Future[tuple[RepoListing, dict[str, FitEstimate]]]:
        """Calls `on_done((listing, fits))`: the repository's models and a badge for each."""
        from backend.models.fit import fit_choices
        from backend.models.hub import list_repo

        def listing_with_fits() -> tuple[RepoListing, dict[str, FitEstimate]]:
            listing = list_repo(repo_id)
            return listing, fit_choices(listing, _machine_memory(), context)

        return self._in_hub(listing_with_fits, on_done=on_done, on_error=on_error)

    def refit(self, listing: RepoListing, context: int, on_done: Callback
              ) -> concurrent.futures.Future[tuple[RepoListing, dict[str, FitEstimate]]]:
        """New badges for another context: local work only (headers of files already here)."""
        from backend.models.fit import fit_choices

        return self.run_in_thread(lambda: (listing, fit_choices(listing, _machine_memory(), context)),
                                  on_done=on_done)

    def download(self, choice: ModelChoice, commit: str) -> str:
        return self.downloads.add(choice, commit)

    def pause_download(self, job_id: str) -> None:
        self.downloads.pause(job_id)

    def resume_download(self, job_id: str) -> None:
        self.downloads.resume(job_id)

    def cancel_download(self, job_id: str) -> None:
        self.downloads.cancel(job_id)

    def save_hf_token(self, token: str, on_error: Callable[[str], None] | None = None) -> None:
        from backend.models.hub import save_token

        self.run_in_thread(save_token, token, on_error=on_error)

    def _in_hub(self, fn: Callable[..., T], *args: Any, on_done: Callback | None,
                on_error: Callable[[str], None] | None) -> concurrent.futures.Future[T]:
        return self._in_pool(self._hub, fn, *args, on_done=on_done, on_error=on_error)


def _machine_memory() -> MachineMemory:
    """RAM and the GPU memory the engines can use.  Detection runs programs (once a
    process): called only from the worker threads, never the GUI thread or the loop."""
    from backend.models.fit import machine_memory

    return machine_memory(detect_accelerators().offload_memory())
