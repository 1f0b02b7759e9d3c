"""The user's own dirs, kept out of the test session's reach and checked afterwards.

`tests/conftest.py` runs this at import, before any fixture: it finds where the product
would write for this user (its config, data, cache, state and log dirs, the Hugging Face
and llama.cpp caches, the desktop entry), lists them, and points every such variable of
the session into one private folder (`isolate`).  The engine that `scripts/setup test`
built and the cached test models stay where they are: their paths are read before the
switch and handed to the suite.  At the session's end the same dirs are listed again, and
anything that appeared, changed or went is named (`Listing.changes_since`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from backend.models.hf_cache import hugging_face_cache
from backend.settings import APP_NAME

__all__ = ["Listing", "UserDirs", "clients_dir", "isolate"]

#: The variables that say where a user's files go; `isolate` sets each into its folder.
XDG_VARIABLES = ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME")
#: Where scripts/install-clients installs the real clients.
CLIENTS_DIR = "GGUF_STUDIO_CLIENTS_DIR"
#: Caches of other tools the product reads or writes models into.
CACHE_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "LLAMA_CACHE")


@dataclass(frozen=True)
class Listing:
    """Every file and folder under some dirs, with its modification time and size."""

    entries: dict[str, tuple[int, int]]

    def changes_since(self, before: Listing) -> list[str]:
        """What differs from `before`, one readable line each ("appeared: PATH", ...)."""
        lines = [f"appeared: {path}" for path in sorted(self.entries.keys() - before.entries.keys())]
        lines += [f"changed: {path}" for path in sorted(self.entries.keys() & before.entries.keys())
                  if self.entries[path] != before.entries[path]]
        lines += [f"went: {path}" for path in sorted(before.entries.keys() - self.entries.keys())]
        return lines


@dataclass(frozen=True)
class UserDirs:
    """Where this user's files are: each folder, and whether all below it counts (the
    product's own dirs) or only what appears in it (the shared ones above them)."""

    whole: tuple[Path, ...]  #: everything below counts
    top: tuple[Path, ...]  #: only their entries count (other programs write deeper)
    #: What the suite installs for itself and keeps between runs, as the engine's build
    #: (the real clients, installed on first use by scripts/install-clients): not counted.
    own_tools: tuple[Path, ...] = ()

    @classmethod
    def of_this_user(cls) -> UserDirs:
        """As the product would find them now (read before `isolate`)."""
        own = [Path(platformdirs.user_config_dir(APP_NAME)), Path(platformdirs.user_data_dir(APP_NAME)),
               Path(platformdirs.user_cache_dir(APP_NAME)), Path(platformdirs.user_state_dir(APP_NAME)),
               Path(platformdirs.user_log_dir(APP_NAME)), hugging_face_cache()]
        if os.environ.get("GGUF_STUDIO_DATA_DIR"):
            own.append(Path(os.environ["GGUF_STUDIO_DATA_DIR"]))
        if os.environ.get("LLAMA_CACHE"):
            own.append(Path(os.environ["LLAMA_CACHE"]))
        data = Path(platformdirs.user_data_dir())
        shared = [Path.home(), Path(platformdirs.user_config_dir()), data,
                  Path(platformdirs.user_cache_dir()), Path(platformdirs.user_state_dir()),
                  data / "applications", data / "icons" / "hicolor" / "scalable" / "apps"]
        return cls(tuple(dict.fromkeys(own)), tuple(dict.fromkeys(shared)), (clients_dir(),))

    def listing(self) -> Listing:
        entries: dict[str, tuple[int, int]] = {}
        for folder in self.top:
            _note(entries, folder)
            if folder.is_dir():
                for entry in os.scandir(folder):
                    # Only that it is there: other programs change what is inside.
                    entries[os.path.join(folder, entry.name)] = (0, 0)
        for folder in self.whole:
            _note(entries, folder)
            for root, dirs, files in os.walk(folder):
                dirs[:] = [name for name in dirs if Path(root) / name not in self.own_tools]
                for name in dirs + files:
                    _note(entries, Path(root) / name)
        for tools in self.own_tools:  # it and the folders above it may appear or change
            for folder in (tools, *tools.parents):
                entries.pop(str(folder), None)
        return Listing(entries)


def isolate(root: Path, engines: Path | None = None) -> dict[str, str]:
    """Point HOME, the XDG dirs, the product's data dir and the model caches into `root`
    (made here), in os.environ; returns the variables set.  The private data dir's
    `engines` is the user's `engines` (a link), so that every process of the session
    finds the engines built there (llama-server, ggml-rpc-server, a GPU build) as the
    product does; they are only read (the session's end check would tell otherwise).
    pip and npm keep the user's own configuration (package index, registry), which would
    otherwise vanish with HOME, and the real clients stay where scripts/install-clients
    put them (GGUF_STUDIO_CLIENTS_DIR).  Call it before anything reads these variables."""
    pip_config = Path(platformdirs.user_config_dir("pip")) / "pip.conf"
    npm_config = Path.home() / ".npmrc"
    changes = {name: str(root / name.lower()) for name in XDG_VARIABLES}
    changes.update(HOME=str(root / "home"), HF_HOME=str(root / "hf-home"),
                   HF_HUB_CACHE=str(root / "hf-home" / "hub"), LLAMA_CACHE=str(root / "llama-cache"),
                   GGUF_STUDIO_DATA_DIR=str(root / "data" / APP_NAME))
    for folder in list(changes.values()):
        Path(folder).mkdir(parents=True, exist_ok=True)
    # The user's own tool settings (package index, npm registry) and the clients the
    # suite installed before stay theirs.
    if pip_config.is_file() and not os.environ.get("PIP_CONFIG_FILE"):
        changes["PIP_CONFIG_FILE"] = str(pip_config)
    if npm_config.is_file() and not os.environ.get("NPM_CONFIG_USERCONFIG"):
        changes["NPM_CONFIG_USERCONFIG"] = str(npm_config)
    changes[CLIENTS_DIR] = str(clients_dir())
    if engines is not None and engines.is_dir():
        (Path(changes["GGUF_STUDIO_DATA_DIR"]) / "engines").symlink_to(engines, target_is_directory=True)
    os.environ.update(changes)
    return changes


def clients_dir() -> Path:
    """Where scripts/install-clients keeps the real clients (as that script decides)."""
    chosen = os.environ.get(CLIENTS_DIR)
    return Path(chosen) if chosen else Path(platformdirs.user_cache_dir(APP_NAME)) / "clients"


def _note(entries: dict[str, tuple[int, int]], path: Path) -> None:
    try:
        stat = path.lstat()
    except OSError:
        return
    entries[str(path)] = (stat.st_mtime_ns, stat.st_size)
