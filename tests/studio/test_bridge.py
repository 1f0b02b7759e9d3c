"""The bridge after shutdown: callbacks still queued on the GUI thread may ask for more work."""

from __future__ import annotations

from pathlib import Path

from backend.settings import Settings
from studio.bridge import ServiceBridge


def test_work_asked_after_shutdown_is_dropped_not_raised(qapp, studio_home: Path, tmp_path: Path):
    bridge = ServiceBridge(Settings(port=0), log_dir=tmp_path / "logs")
    bridge.shutdown()
    asked: list[str] = []
    future = bridge.run_in_thread(asked.append, "scan", on_done=asked.append)
    assert future.cancelled() and asked == []
    assert bridge.search_models("tiny", "downloads", on_done=asked.append, on_error=asked.append).cancelled()
