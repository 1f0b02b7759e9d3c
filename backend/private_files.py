"""Files private to the user: 0600 in a 0700 directory, written atomically.

The settings (which hold the owner's API key), the named keys' store and the usage
ledger are written this way.  A file or directory left readable by others (an older
version wrote 0644, or a user copied the folder) is made private again whenever it is
loaded (`make_private`).  Modes mean little on Windows; there both functions only write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from backend.errors import SettingsError

__all__ = ["PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "make_private", "write_private"]

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def make_private(path: Path) -> None:
    """Make the file (0600) and its directory (0700) private to the user where others
    may read them.  The directory only if it is the user's own (a file kept in a shared
    directory such as /tmp leaves that directory alone)."""
    if os.name == "nt":
        return
    for target, is_dir in ((path.parent, True), (path, False)):
        try:
            info = target.stat()
        except OSError:
            continue
        if not info.st_mode & 0o077 or (is_dir and info.st_uid != os.getuid()):
            continue
        try:
            os.chmod(target, info.st_mode & 0o700)
        except OSError as exc:
            raise SettingsError(f"{target.name} is readable by other users and could not be "
                                f"made private ({exc.strerror}).") from None


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (a reader sees the old file or the new one,
    never half of one), the file 0600 in a 0700 directory made if missing.

    Each write has a temporary file of its own: two writers at once (the port's autosave
    beside a flush, or `gguf-studio keys` beside the running app) must not rename one
    another's half-written file away."""
    path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    make_private(path)
    # mkstemp creates the file 0600 whatever the umask.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
