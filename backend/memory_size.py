"""Memory as the window and the logs say it: one unit family (binary: MiB, GiB), so a
model's memory reads the same in the model pane, the Pool tab and the log."""

from __future__ import annotations

__all__ = ["format_memory"]

MiB = 1 << 20
GiB = 1 << 30


def format_memory(n: int) -> str:
    """`n` bytes: "512 KiB", "277 MiB", "1.5 GiB"."""
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    if n >= MiB:
        return f"{n / MiB:.0f} MiB"
    return f"{max(0, n) / 1024:.0f} KiB"
