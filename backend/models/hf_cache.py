"""The Hugging Face cache on disk, and the checks that keep a hub's answers inside it.

The layout is huggingface_hub's, so other tools (and llama.cpp's `-hf`) share the files:

    <cache>/models--<owner>--<name>/blobs/<sha256 or git blob id>         a verified file
                                    blobs/<id>.incomplete                  one being fetched
                                    snapshots/<commit>/<path in repo>      a link to its blob
                                    refs/main                              the commit of `main`
    <cache>/.locks/models--<owner>--<name>/<id>.lock                       one fetch per blob

Every value that becomes part of a path (a repository id, a commit id, a checksum, a
file name) comes from a hub or from a saved download, and a hub is input, not truth: a
mirror, a proxy or a spoofed plain-http endpoint may answer anything.  So each one is
checked here before a path is built from it, and every path handed out is checked to lie
inside `blobs/` or `snapshots/<commit>/` of its repository folder (as huggingface_hub's
pointer-path check does).  A refusal is an `UnsafeHubAnswer` that says which value.
"""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from backend.errors import UnsafeHubAnswer

__all__ = [
    "RepoCache",
    "check_blob_id",
    "check_commit",
    "check_file_name",
    "check_repo_id",
    "check_sha256",
    "hugging_face_cache",
    "printable",
    "printable_lines",
    "repo_cache",
    "repo_id_of_folder",
]

COMMIT = re.compile(r"[0-9a-f]{40}")
SHA256 = re.compile(r"[0-9a-f]{64}")
GIT_BLOB_ID = re.compile(r"[0-9a-f]{40}")  # what the hub's ETag is for a file kept in git, not LFS
# huggingface_hub's own rule for repository ids, without its optional missing owner.
REPO_ID = re.compile(r"[A-Za-z0-9_.\-]{1,96}/[A-Za-z0-9_.\-]{1,96}")
REPO_PREFIX = "models--"


@dataclass(frozen=True)
class RepoCache:
    """One repository's folder in the cache; each path it hands out is checked first."""

    repo_id: str
    root: Path  # the cache, e.g. ~/.cache/huggingface/hub

    @property
    def folder(self) -> Path:
        return self.root / _folder_name(self.repo_id)

    @property
    def blobs(self) -> Path:
        return self.folder / "blobs"

    def blob(self, blob_id: str) -> Path:
        """Where a verified file lies: `blob_id` is its SHA-256, or its git blob id."""
        return _inside(self.blobs / check_blob_id(blob_id), self.blobs)

    def incomplete(self, blob_id: str) -> Path:
        blob = self.blob(blob_id)
        return blob.with_name(blob.name + ".incomplete")

    def lock(self, blob_id: str) -> Path:
        """The lock huggingface_hub itself takes for this blob, so the two never fetch it at once."""
        locks = self.root / ".locks" / _folder_name(self.repo_id)
        return _inside(locks / f"{check_blob_id(blob_id)}.lock", locks)

    def snapshot(self, commit: str) -> Path:
        return self.folder / "snapshots" / check_commit(commit)

    def pointer(self, commit: str, file_name: str) -> Path:
        """Where the file appears at `commit`: the path llama-server and other tools open."""
        snapshot = self.snapshot(commit)
        return _inside(snapshot / check_file_name(file_name), snapshot)

    def ref(self, name: str = "main") -> Path:
        return self.folder / "refs" / name

    def linked_blobs(self) -> set[str]:
        """Names of the blobs some snapshot (of any commit, made by any tool) links to."""
        linked: set[str] = set()
        snapshots = self.folder / "snapshots"
        blobs = os.path.abspath(self.blobs)
        for folder, _dirs, files in os.walk(snapshots, onerror=lambda _e: None):
            for name in files:
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    continue
                target = os.path.abspath(os.path.join(folder, os.readlink(path)))
                if os.path.dirname(target) == blobs:
                    linked.add(os.path.basename(target))
        return linked


def repo_cache(repo_id: str, cache_dir: Path | None = None) -> RepoCache:
    return RepoCache(check_repo_id(repo_id), Path(cache_dir) if cache_dir else hugging_face_cache())


def hugging_face_cache(environ: Mapping[str, str] | None = None, home: Path | None = None) -> Path:
    """The Hugging Face hub cache, as huggingface_hub itself decides it (read at call time)."""
    environ = os.environ if environ is None else environ
    home = Path(home) if home else Path.home()
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    cache = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else home / ".cache"
    return cache / "huggingface" / "hub"


def repo_id_of_folder(name: str) -> str | None:
    """"owner/name" for a cache folder named models--owner--name; None for any other folder."""
    if not name.startswith(REPO_PREFIX) or "--" not in name[len(REPO_PREFIX):]:
        return None
    return "/".join(name[len(REPO_PREFIX):].split("--", 1))


# --- checks ----------------------------------------------------------------------------------


def check_repo_id(repo_id: str) -> str:
    if not isinstance(repo_id, str) or not REPO_ID.fullmatch(repo_id) \
            or ".." in repo_id or "--" in repo_id:
        raise UnsafeHubAnswer(f"“{printable(repo_id)}” is not a Hugging Face repository id "
                              "(owner/name); refused.")
    return repo_id


def check_commit(commit: str) -> str:
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise UnsafeHubAnswer(f"Hugging Face answered “{printable(commit)}” as a commit id, which "
                              "is not one (40 hex digits); refused, nothing was written.")
    return commit


def check_sha256(value: str) -> str:
    if not isinstance(value, str) or not SHA256.fullmatch(value):
        raise UnsafeHubAnswer(f"Hugging Face answered “{printable(value)}” as a SHA-256, which "
                              "is not one (64 hex digits); refused, nothing was written.")
    return value


def check_blob_id(value: str) -> str:
    """A blob's name: an LFS file's SHA-256, or the git blob id of a file kept in git."""
    if not isinstance(value, str) or not (SHA256.fullmatch(value) or GIT_BLOB_ID.fullmatch(value)):
        raise UnsafeHubAnswer(f"Hugging Face identified a file as “{printable(value)}”, which is "
                              "neither a SHA-256 nor a git blob id; refused, nothing was written.")
    return value


def check_file_name(name: str) -> str:
    """A file's path in its repository: relative, POSIX, every part a plain name."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if (not isinstance(name, str) or "\\" in name or any(_is_control(c) for c in name)
            or any(part in ("", ".", "..") or _DRIVE.match(part) for part in parts)):
        raise UnsafeHubAnswer(f"Hugging Face named a file “{printable(name)}”, which would lead out of "
                              "the model's folder; refused, nothing was written.")
    return name


def printable(text: object, limit: int = 200) -> str:
    """`text` without control characters or escape codes (shown as \\x1b and the like),
    cut to `limit` characters: safe for a terminal and for a message."""
    text = str(text)
    shown = "".join(c.encode("unicode_escape").decode("ascii") if _is_control(c) else c for c in text)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def printable_lines(text: str) -> str:
    """`text` with its line breaks kept and every other control character or escape code
    shown escaped: messages can carry a hub's strings, which must not drive the terminal."""
    return "\n".join(printable(line, 100_000) for line in text.split("\n"))


# --- helpers -----------------------------------------------------------------------------------

_DRIVE = re.compile(r"[A-Za-z]:")
# Bidirectional overrides reorder what a terminal or a label shows (a name can appear to
# end in .gguf when it does not): treated like control characters.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _is_control(c: str) -> bool:
    return unicodedata.category(c) == "Cc" or c in _BIDI


def _folder_name(repo_id: str) -> str:
    return REPO_PREFIX + check_repo_id(repo_id).replace("/", "--")


def _inside(path: Path, folder: Path) -> Path:
    # abspath, not resolve: the links inside the cache are meant to point elsewhere in it.
    if Path(os.path.abspath(folder)) not in Path(os.path.abspath(path)).parents:
        raise UnsafeHubAnswer(f"“{printable(path.name)}” would lie outside the Hugging Face cache "
                              "folder; refused, nothing was written.")
    return path
