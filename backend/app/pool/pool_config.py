"""The pool's configuration: the models this machine serves and how, and the engines
elsewhere that join the port.

Plain values, each checked whole when made.  `serve` builds a `PoolConfig` from its flags
and the models file (`backend.app.pool.models_file`), merged (`PoolConfig.merge`);
`backend.app.pool.pool` runs it.

Names: a model answers to its name, its aliases, and the names its file gives it, by the
one rule of `backend.models.model_names` (which the pool follows too): compared
regardless of case; a name or alias given to two models is an error naming both lines;
a file-given name two models share is dropped from both (they are asked for by their own
names).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from backend.api_keys import read_api_key_file
from backend.errors import SettingsError
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSettings, LoadSpec
from backend.llama.remote_engine import normalise_base_url
from backend.models.model_names import ModelNames, NamedModel, check_name, file_names, model_name
from backend.settings import check_placement

__all__ = ["EMBEDDINGS_FLAG", "EMBEDDINGS_SPELLINGS", "ISOLATED_FLAGS", "ModelEntry", "PoolConfig",
           "UpstreamEntry", "check_distinct_upstreams"]

#: The llama-server flag an embeddings model is started with (llama.cpp also reads `--embedding`).
EMBEDDINGS_FLAG = "--embeddings"
#: The flags that start an engine for embeddings, as an entry's extra arguments may spell them.
EMBEDDINGS_SPELLINGS = frozenset({"--embedding", "--embeddings"})
#: An isolated model's engine reuses no request's prompt for another: prompt caching off
#: by default (the port also sends every request with `cache_prompt: false`, which a
#: client could otherwise turn back on) and no prompt cache in RAM.  Given last, so they
#: win over the same flags in extra_args.
ISOLATED_FLAGS = ("--no-cache-prompt", "--cache-ram", "0")


@dataclass(frozen=True)
class ModelEntry:
    """One GGUF file this machine serves, with how to load it and keep it."""

    name: str  #: the id clients use: the name given, else the file name without .gguf
    path: str  #: the GGUF file (for split files the first part)
    settings: LoadSettings = LoadSettings()
    aliases: tuple[str, ...] = ()  #: other names the operator gave it (file-given ones: `file_names`)
    pinned: bool = False  #: never unloaded, neither to make room nor for idleness
    idle_ttl: float = 0.0  #: seconds without a request before it is unloaded; 0: never
    embeddings: bool = False  #: started with --embeddings; /v1/embeddings goes to it
    preload: bool = True  #: loaded at start; else on its first request
    #: no prompt cache shared between requests (keys that are strangers): see ISOLATED_FLAGS
    isolated: bool = False
    #: its line's placement policy (backend.settings.PLACEMENTS); "": the port's setting
    placement: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "aliases", tuple(self.aliases))
        check_name(self.name, "A model's name")
        for alias in self.aliases:
            check_name(alias, f"An alias of {self.name}")
        if not isinstance(self.path, str) or not self.path.strip():
            raise SettingsError(f"The model {self.name} needs the path of its GGUF file.")
        if isinstance(self.idle_ttl, bool) or not isinstance(self.idle_ttl, (int, float)) \
                or not math.isfinite(self.idle_ttl) or self.idle_ttl < 0:
            raise SettingsError(f"The idle TTL of {self.name} must be 0 (never) or a number of "
                                f"seconds, not {self.idle_ttl!r}.")
        object.__setattr__(self, "idle_ttl", float(self.idle_ttl))
        if self.pinned and self.idle_ttl:
            raise SettingsError(f"{self.name} is pinned, so it is never unloaded and an idle TTL "
                                "cannot apply: drop one of them.")
        self.settings.validate()
        if self.placement:
            object.__setattr__(self, "placement", check_placement(self.placement))
        flagged = any(arg in EMBEDDINGS_SPELLINGS for arg in self.settings.extra_args)
        if self.embeddings and not flagged:
            object.__setattr__(self, "settings", dataclasses.replace(
                self.settings, extra_args=(*self.settings.extra_args, EMBEDDINGS_FLAG)))
        elif flagged:
            object.__setattr__(self, "embeddings", True)

    @classmethod
    def for_file(cls, path: str | os.PathLike[str], name: str | None = None,
                 **fields: Any) -> "ModelEntry":
        """The entry for the GGUF file at `path`, named `name` or after its file."""
        path = os.fspath(path)
        return cls(name=name or model_name(path), path=path, **fields)

    def file_names(self) -> tuple[str, ...]:
        """The names its file gives it (see `file_names`)."""
        return file_names(self.path)

    @property
    def named(self) -> NamedModel:
        """It as `ModelNames` sees it."""
        return NamedModel(self.name, self.aliases, self.path)

    def to_spec(self, *, own_template: bool = True) -> LoadSpec:
        """The load; `own_template`: whether the file carries a chat template of its own
        (its chat template setting is `settings.chat_template`)."""
        settings = self.settings if not self.isolated else dataclasses.replace(
            self.settings, extra_args=(*self.settings.extra_args, *ISOLATED_FLAGS))
        return settings.to_spec(self.path, own_template=own_template, model_id=self.name)


@dataclass(frozen=True)
class UpstreamEntry:
    """An engine elsewhere: a llama-server or another GGUF Studio port."""

    url: str  #: its base URL, as `normalise_base_url` gives it
    api_key: str | None = field(default=None, repr=False)  #: the key it requires
    kv_layout: KvLayout | None = None  #: a plain llama-server's cache, as its operator states it
    #: Where `api_key` was read from; written back in its place, so the key stays out.
    api_key_file: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalise_base_url(self.url))
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or any(c.isspace() or not c.isprintable() for c in self.api_key)):
            raise SettingsError(f"The key of the upstream {self.url} must be one word of "
                                "printable characters.")

    @classmethod
    def with_key_file(cls, url: str, api_key_file: str | os.PathLike[str] | None,
                      kv_layout: KvLayout | None = None) -> "UpstreamEntry":
        """The upstream at `url` whose key is in `api_key_file` (read now; None: no key)."""
        if not api_key_file:
            return cls(url, kv_layout=kv_layout)
        key_file = os.path.abspath(os.path.expanduser(os.fspath(api_key_file)))
        return cls(url, read_api_key_file(key_file), kv_layout, key_file)


@dataclass(frozen=True)
class PoolConfig:
    """Every model and upstream of the port.  Checked whole when made: names unique,
    upstreams distinct, the default model known."""

    models: tuple[ModelEntry, ...] = ()
    upstreams: tuple[UpstreamEntry, ...] = ()
    default_model: str | None = None  #: a name or alias; else the first chat model
    memory_limit_mib: int = 0  #: 0: the machine's (RAM, and VRAM as the fit estimate sees it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "upstreams", tuple(self.upstreams))
        if isinstance(self.memory_limit_mib, bool) or not isinstance(self.memory_limit_mib, int) \
                or self.memory_limit_mib < 0:
            raise SettingsError("The memory limit must be a whole number of MiB, 0 for the "
                                f"machine's, not {self.memory_limit_mib!r}.")
        object.__setattr__(self, "_names", ModelNames(m.named for m in self.models))
        check_distinct_upstreams(self.upstreams, lambda i: self.upstreams[i].url)
        if self.default_model is not None:
            check_name(self.default_model, "The default model")
            # A GGUF Studio upstream's models are known only once it answers.
            if self.resolve(self.default_model) is None and not self.upstreams:
                raise SettingsError(f"The default model {self.default_model!r} is none of the "
                                    f"models: {_listing(self.models)}.")

    # --- names --------------------------------------------------------------------------

    def resolve(self, name: str | None) -> ModelEntry | None:
        """The model a request's `model` asks for: by name, alias or file-given name,
        regardless of case; no name (None or "") means the default.  None when unknown
        here (it may still be an upstream's)."""
        if not name:
            return self.default
        found = self._table.resolve(name)
        return next((m for m in self.models if m.name == found), None)

    def names(self, entry: ModelEntry) -> tuple[str, ...]:
        """Every name `entry` answers to: its name first, then its aliases, then the
        names its file gives it that no other model claims."""
        return self._table.names_of(entry.name)

    @property
    def default(self) -> ModelEntry | None:
        """The model a request that names none goes to: `default_model`, else the first
        chat model, else the first model.  None without local models, or when
        `default_model` is none of them (an upstream's)."""
        if self.default_model:
            return self.resolve(self.default_model)
        chat = [m for m in self.models if not m.embeddings]
        return next(iter(chat or self.models), None)

    @property
    def _table(self) -> ModelNames:
        table: ModelNames = self.__dict__["_names"]
        return table

    # --- combining --------------------------------------------------------------------

    def merge(self, other: "PoolConfig") -> "PoolConfig":
        """This configuration with `other`'s on top (the command line's over the models
        file's): its models and upstreams added, its default model and memory limit
        taking over where it sets them.  A model of `other` for a file already here,
        under no name of its own, is the one already here; an upstream at a URL already
        here keeps the key and layout `other` does not state."""
        here = {_same_file(m.path) for m in self.models}
        models = list(self.models)
        for entry in other.models:
            if _same_file(entry.path) in here and entry.name == model_name(entry.path):
                continue
            models.append(entry)
        upstreams = list(self.upstreams)
        for upstream in other.upstreams:
            index = next((i for i, u in enumerate(upstreams) if u.url == upstream.url), None)
            if index is None:
                upstreams.append(upstream)
                continue
            old = upstreams[index]
            keyed = upstream if upstream.api_key is not None else old
            upstreams[index] = UpstreamEntry(upstream.url, keyed.api_key,
                                             upstream.kv_layout or old.kv_layout, keyed.api_key_file)
        return PoolConfig(tuple(models), tuple(upstreams),
                          other.default_model or self.default_model,
                          other.memory_limit_mib or self.memory_limit_mib)



def check_distinct_upstreams(upstreams: tuple[UpstreamEntry, ...],
                             describe: Callable[[int], str]) -> None:
    """SettingsError when two of `upstreams` have one URL (`describe(i)` names the second)."""
    seen: set[str] = set()
    for i, upstream in enumerate(upstreams):
        if upstream.url in seen:
            raise SettingsError(f"The upstream {describe(i)} is given twice.")
        seen.add(upstream.url)


# --- helpers ----------------------------------------------------------------------------

def _listing(models: Iterable[ModelEntry]) -> str:
    names = [m.name for m in models]
    return ", ".join(names) if names else "there are none"


def _same_file(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))
