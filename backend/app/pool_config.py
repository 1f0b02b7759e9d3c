"""What the pool serves: local models with their own settings, and engines elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSettings

__all__ = ["ModelEntry", "PoolConfig", "UpstreamEntry"]


@dataclass(frozen=True)
class ModelEntry:
    """A GGUF file on this machine that the pool may load, and how."""

    name: str  #: the id clients use: the alias, else the file name without .gguf
    path: str  #: the GGUF file (for split files the first part)
    settings: LoadSettings = field(default_factory=LoadSettings)
    aliases: tuple[str, ...] = ()  #: other names accepted
    pinned: bool = False  #: never unloaded to make room, nor for idleness
    idle_ttl: float = 0.0  #: seconds idle before it is unloaded; 0: never
    embeddings: bool = False  #: started with --embeddings; /v1/embeddings goes to it
    chat_template: bool = True
    preload: bool = True  #: loaded at start; else on the first request

    @classmethod
    def for_file(cls, path: str, **fields: object) -> "ModelEntry":
        name = str(fields.pop("name", "") or Path(path).name.removesuffix(".gguf"))
        return cls(name=name, path=str(path), **fields)  # type: ignore[arg-type]

    @property
    def names(self) -> tuple[str, ...]:
        """Every name that reaches this model: its own, its aliases, its file's."""
        file = Path(self.path).name
        return tuple(dict.fromkeys((self.name, *self.aliases, file, file.removesuffix(".gguf"))))


@dataclass(frozen=True)
class UpstreamEntry:
    """An engine on another machine: a llama-server or another GGUF Studio port."""

    url: str
    api_key: str | None = field(default=None, repr=False)
    kv_layout: KvLayout | None = None


@dataclass(frozen=True)
class PoolConfig:
    models: tuple[ModelEntry, ...] = ()
    upstreams: tuple[UpstreamEntry, ...] = ()
    default_model: str | None = None  #: else the first model
    memory_limit_mib: int = 0  #: 0: this machine's memory, as the fit estimate sees it
