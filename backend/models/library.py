"""The GGUF files a person can load: opened ones, added folders, and the usual caches.

The library remembers what the user told it (files opened, folders added, when each
model was last loaded, and the load settings of each) in one JSON file in the config
dir.  What lies on disk is found again by `scan`, which only lists files and stats
them; reading a model's metadata is `gguf_info`'s job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import platformdirs

from backend.errors import SettingsError
from backend.llama.load import LoadSettings
from backend.models.hf_cache import hugging_face_cache, repo_id_of_folder
from backend.private_files import write_private
from backend.settings import APP_NAME

__all__ = [
    "SOURCE_LABELS",
    "Location",
    "ModelEntry",
    "ModelLibrary",
    "default_locations",
    "find_gguf_files",
    "in_shown_order",
    "library_path",
    "search",
]

log = logging.getLogger("gguf_studio.library")

SOURCE_LABELS = {
    "opened": "Opened",
    "folder": "Folder",
    "huggingface": "Hugging Face",
    "lmstudio": "LM Studio",
    "llama.cpp": "llama.cpp cache",
}


@dataclass(frozen=True)
class Location:
    source: str  # a key of SOURCE_LABELS
    path: Path


@dataclass(frozen=True)
class ModelEntry:
    path: str
    name: str  # the file name without .gguf
    source: str
    detail: str  # e.g. the Hugging Face repo, "" when there is nothing to add
    size: int
    modified: float
    last_used: float | None = None
    exists: bool = True

    @property
    def source_label(self) -> str:
        return SOURCE_LABELS.get(self.source, self.source)


class ModelLibrary:
    """What the user opened and added, remembered across restarts.

    Mutations happen on one thread (the window's); `scan` may run on another, and works
    on a copy of the lists taken under a lock; so may `save`, given a `document()` copied
    on the window's thread.
    """

    def __init__(self, path: Path | None = None,
                 locations: Iterable[Location] | None = None) -> None:
        self.path = Path(path) if path else library_path()
        self._locations = list(locations) if locations is not None else None
        self.opened: list[str] = []
        self.folders: list[str] = []
        self.recent: dict[str, float] = {}
        self._load_settings: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    # --- persistence ----------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | None = None,
             locations: Iterable[Location] | None = None) -> "ModelLibrary":
        """The saved library; an unreadable file gives an empty one (and is kept aside)."""
        library = cls(path, locations)
        try:
            data = json.loads(library.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except FileNotFoundError:
            return library
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable model library %s: %s", library.path, exc)
            return library
        library.opened = _strings(data.get("opened"))
        library.folders = _strings(data.get("folders"))
        library.recent = {str(k): float(v) for k, v in _mapping(data.get("recent")).items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}
        library._load_settings = {str(k): dict(v) for k, v in _mapping(data.get("load_settings")).items()
                                  if isinstance(v, dict)}
        return library

    def document(self) -> dict[str, Any]:
        """What `save` writes, copied: a value another thread may write later."""
        with self._lock:
            return {"version": 1, "opened": list(self.opened), "folders": list(self.folders),
                    "recent": dict(self.recent), "load_settings": dict(self._load_settings)}

    def save(self, document: dict[str, Any] | None = None) -> None:
        """Write `document` (by default the library as it is now), atomically."""
        data = self.document() if document is None else document
        write_private(self.path, json.dumps(data, indent=2).encode())

    # --- what the user says ------------------------------------------------------------

    def add_file(self, path: str | os.PathLike[str]) -> str:
        key = _key(path)
        with self._lock:
            if key not in self.opened:
                self.opened.insert(0, key)
        return key

    def add_folder(self, path: str | os.PathLike[str]) -> str:
        key = _key(path)
        with self._lock:
            if key not in self.folders:
                self.folders.append(key)
        return key

    def remove_folder(self, path: str | os.PathLike[str]) -> None:
        key = _key(path)
        with self._lock:
            self.folders = [f for f in self.folders if f != key]

    def forget(self, path: str | os.PathLike[str]) -> None:
        """Drop a model from the opened files and from the recent ones."""
        key = _key(path)
        with self._lock:
            self.opened = [p for p in self.opened if p != key]
            self.recent.pop(key, None)

    def mark_used(self, path: str | os.PathLike[str], when: float | None = None) -> None:
        with self._lock:
            self.recent[_key(path)] = time.time() if when is None else when

    def settings_for(self, path: str | os.PathLike[str]) -> LoadSettings:
        with self._lock:
            saved = self._load_settings.get(_key(path))
        return LoadSettings.from_dict(saved) if saved else LoadSettings()

    def remember_settings(self, path: str | os.PathLike[str], settings: LoadSettings) -> None:
        with self._lock:
            self._load_settings[_key(path)] = settings.to_dict()

    # --- what is on disk ------------------------------------------------------------------

    def locations(self) -> list[Location]:
        """Where models are looked for: the user's folders, then the usual caches."""
        with self._lock:
            folders = list(self.folders)
        found = [Location("folder", Path(f)) for f in folders]
        found += self._locations if self._locations is not None else default_locations()
        return found

    def scan(self) -> list[ModelEntry]:
        """Every model the library knows of, recently used first, then by name."""
        with self._lock:
            opened = list(self.opened)
            recent = dict(self.recent)
        entries: list[ModelEntry] = []
        seen: set[str] = set()

        def add(path: Path, source: str, detail: str = "") -> None:
            try:
                real = os.path.realpath(path)
            except OSError:
                real = str(path)
            if real in seen:
                return
            seen.add(real)
            key = _key(path)
            try:
                st = path.stat()
                size, modified, exists = st.st_size, st.st_mtime, True
            except OSError:
                size, modified, exists = 0, 0.0, False
            entries.append(ModelEntry(key, _display_name(path), source, detail, size, modified,
                                      recent.get(key), exists))

        for opened_path in opened:
            add(Path(opened_path), "opened")
        for location in self.locations():
            for found in find_gguf_files(location.path):
                add(found, location.source, _detail(location, found))
        # Recently used ones that came from somewhere no longer scanned stay listed.
        for recent_path in recent:
            if os.path.isfile(recent_path):
                add(Path(recent_path), "opened")
        entries.sort(key=lambda e: (e.last_used is None, -(e.last_used or 0), e.name.lower(), e.path))
        return entries


def search(entries: Iterable[ModelEntry], query: str) -> list[ModelEntry]:
    """Entries matching every word of `query` in their name, detail, source or path."""
    words = query.lower().split()
    if not words:
        return list(entries)
    found = []
    for entry in entries:
        haystack = " ".join((entry.name, entry.detail, entry.source_label, entry.path)).lower()
        if all(word in haystack for word in words):
            found.append(entry)
    return found


def in_shown_order(entries: Iterable[ModelEntry], shown: Iterable[str]) -> list[ModelEntry]:
    """`entries` with those already `shown` (their paths, in order) keeping their places
    and the new ones after them in `entries`' order: a list people are looking at does
    not reorder under them because a model was loaded (its last use changed)."""
    by_path = {entry.path: entry for entry in entries}
    kept = [by_path.pop(path) for path in shown if path in by_path]
    return kept + list(by_path.values())


def library_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "library.json"


def default_locations(environ: Mapping[str, str] | None = None,
                      home: Path | None = None) -> list[Location]:
    """The folders where other tools keep GGUF files, as each tool itself decides them."""
    environ = os.environ if environ is None else environ
    home = Path(home) if home else Path.home()
    cache = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else home / ".cache"

    hf = hugging_face_cache(environ, home)

    if environ.get("LLAMA_CACHE"):
        llama = Path(environ["LLAMA_CACHE"])
    elif os.name == "nt" and environ.get("LOCALAPPDATA"):
        llama = Path(environ["LOCALAPPDATA"]) / "llama.cpp"
    elif sys.platform == "darwin":
        llama = home / "Library" / "Caches" / "llama.cpp"
    else:
        llama = cache / "llama.cpp"

    return [
        Location("huggingface", hf),
        Location("lmstudio", home / ".lmstudio" / "models"),
        Location("lmstudio", home / ".cache" / "lm-studio" / "models"),
        Location("llama.cpp", llama),
    ]


def find_gguf_files(root: Path, *, max_depth: int = 8, limit: int = 10_000) -> Iterator[Path]:
    """Loadable GGUF files under `root`: no projectors, only the first part of a split."""
    root = Path(root)
    if not root.is_dir():
        return
    count = 0
    root_depth = len(root.parts)
    # followlinks=False: the HF cache links files, not folders, and a folder link loop
    # must not hang the scan.
    for folder, dirs, files in os.walk(root, onerror=lambda _e: None):
        depth = len(Path(folder).parts) - root_depth
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "blobs") \
            if depth < max_depth else []
        for name in sorted(files):
            if not _is_loadable_name(name):
                continue
            yield Path(folder) / name
            count += 1
            if count >= limit:
                return


# --- helpers ------------------------------------------------------------------------------

_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def _is_loadable_name(name: str) -> bool:
    lowered = name.lower()
    if not lowered.endswith(".gguf") or lowered.startswith("."):
        return False
    # Vision projectors are GGUF files too, but not models llama-server can load alone.
    if lowered.startswith("mmproj") or "-mmproj" in lowered:
        return False
    split = _SPLIT_PART.search(name)
    return split is None or int(split.group(1)) == 1


def _display_name(path: Path) -> str:
    name = path.name
    return name[:-5] if name.lower().endswith(".gguf") else name


def _detail(location: Location, path: Path) -> str:
    try:
        relative = path.relative_to(location.path)
    except ValueError:
        return ""
    parts = relative.parts
    if location.source == "huggingface" and parts and (repo_id := repo_id_of_folder(parts[0])):
        return repo_id
    if location.source == "lmstudio" and len(parts) >= 3:
        return f"{parts[0]}/{parts[1]}"
    if location.source == "folder":
        return str(location.path)
    return ""


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _mapping(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _key(path: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(path)))
