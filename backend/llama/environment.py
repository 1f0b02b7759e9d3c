"""The environment the engine's processes get: llama-server, its build tools, apt; and
the tie that ends llama-server and the RPC server with the process that started them."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping

__all__ = ["die_with_parent", "engine_environment"]


def engine_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the engine's processes (llama-server, its build tools, apt):
    ours without the app's own settings (the port's key among them) and without
    credentials, which none of them needs: hub tokens and any *_TOKEN, *_API_KEY,
    *_SECRET, *_PASSWORD."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items() if not _is_withheld(name)}


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the child when this process dies, even by
    SIGKILL (an engine or an open RPC port must not outlive its owner); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    parent_pid = os.getpid()

    def preexec() -> None:
        import ctypes
        PR_SET_PDEATHSIG = 1
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    return preexec


def _is_withheld(name: str) -> bool:
    upper = name.upper()
    return (upper.startswith("GGUF_STUDIO_") or upper in _HUB_TOKENS
            or upper.endswith(("_TOKEN", "_API_KEY", "_SECRET", "_SECRET_KEY", "_PASSWORD")))


_HUB_TOKENS = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"})
