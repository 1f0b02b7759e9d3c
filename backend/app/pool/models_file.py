"""The models file: the pool's configuration as an operator writes it, read and written.

The models file is TOML, read with the standard library's `tomllib`: it takes comments,
so an operator can write down why a model is pinned; it has no indentation to get wrong
(YAML) and no braces and commas to balance (JSON, which takes no comments either); and
Codex's own config.toml, which the same people edit, is TOML too.

    default_model = "coder"        # else the first model
    memory_limit_mib = 20000       # else the machine's (RAM, and VRAM as the fit estimate sees it)

    [[model]]
    path = "~/models/Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf"
    name = "coder"                 # else the file name without .gguf
    aliases = ["qwen"]
    ctx_size = 32768
    parallel = 4
    pinned = true                  # never unloaded
    # rpc = ["10.0.0.3:50052"]     # spread over `gguf-studio rpc-worker`s (trusted wired network only)

    [[model]]
    path = "nomic-embed-text-v1.5.Q8_0.gguf"   # relative to this file's folder
    embeddings = true              # started with --embeddings; /v1/embeddings goes to it
    idle_ttl = "30m"               # unloaded after 30 minutes without a request
    preload = false                # loaded on its first request
    # isolated = true              # no prompt cache shared between requests (keys that are strangers)
    # placement = "hash-ring"      # its sessions on a consistent-hash ring of its engines

    [[model]]
    path = "gemma-3-270m-q4_k_m.gguf"
    chat_template = "gemma"        # it has none: llama.cpp's built-in gemma (or a .jinja file;
                                   # false: none, chat requests refused, /v1/completions only)

    [[upstream]]
    url = "http://10.0.0.2:8899"
    api_key_file = "box2.key"      # its key, kept out of this file
    kv_layout = "split"            # what a plain llama-server cannot report

An upstream's key is best kept in a file of its own (`api_key_file`).  A models file
that holds a key itself (`api_key`) is made private (0600) when it is read, as the
settings are, and is written private.

The values it holds are `backend.app.pool.pool_config`'s.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any, Mapping

from backend.errors import SettingsError
from backend.llama.chat_template import (BUILT_IN_TEMPLATES, NO_TEMPLATE, OWN_TEMPLATE,
                                         check_chat_template, resolved_chat_template)
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSettings
from backend.models.model_names import ModelNames
from backend.settings import PLACEMENTS, check_placement
from backend.rpc_workers import parse_rpc_workers
from backend.app.pool.pool_config import (EMBEDDINGS_SPELLINGS, ModelEntry, PoolConfig, UpstreamEntry,
                                     check_distinct_upstreams)
from backend.toml_text import toml_key, toml_value

__all__ = ["models_file_text", "parse_duration", "parse_models_file", "read_models_file",
           "write_models_file"]

log = logging.getLogger("gguf_studio.pool_config")


def read_models_file(path: str | os.PathLike[str]) -> PoolConfig:
    """The models file at `path`.  Paths in it are relative to its folder.  Raises
    SettingsError naming the line and field of anything unusable."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "not UTF-8 text"
        raise SettingsError(f"The models file {path.name} cannot be read ({reason}).") from None
    config = parse_models_file(text, folder=path.parent.absolute(), source=path.name)
    if any(u.api_key is not None and u.api_key_file is None for u in config.upstreams):
        _make_private(path)
    return config

def parse_models_file(text: str, *, folder: Path | None = None,
                      source: str = "the models file") -> PoolConfig:
    """A models file's text; relative paths are taken from `folder` (else the
    current directory); `source` names the file in messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{source} is not valid TOML: {exc}.") from None
    return _Reader(text, source, Path(folder) if folder else Path.cwd()).config(data)

def models_file_text(config: PoolConfig, folder: Path | None = None) -> str:
    """The models file for `config`; `parse_models_file` reads back an equal one.
    Paths inside `folder` are written relative to it.  Comments are not kept."""
    lines = ["# GGUF Studio models file: `gguf-studio serve --models-file FILE`."]
    if config.default_model:
        lines.append(f"default_model = {toml_value(config.default_model)}")
    if config.memory_limit_mib:
        lines.append(f"memory_limit_mib = {config.memory_limit_mib}")
    for entry in config.models:
        lines += ["", "[[model]]"]
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in _model_fields(entry, folder)]
    for upstream in config.upstreams:
        lines += ["", "[[upstream]]", f"url = {toml_value(upstream.url)}"]
        if upstream.api_key_file:
            lines.append(f"api_key_file = {toml_value(_written_path(upstream.api_key_file, folder))}")
        elif upstream.api_key is not None:
            lines.append(f"api_key = {toml_value(upstream.api_key)}")
        if upstream.kv_layout is not None:
            lines.append(f"kv_layout = {toml_value(upstream.kv_layout.value)}")
    return "\n".join(lines) + "\n"

def write_models_file(config: PoolConfig, path: str | os.PathLike[str]) -> None:
    """Write the models file atomically: private (0600) when it holds a key itconfig."""
    path = Path(path).expanduser()
    private = any(u.api_key is not None and not u.api_key_file for u in config.upstreams)
    data = models_file_text(config, path.parent.absolute()).encode()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as file:
        if private and os.name != "nt":
            os.fchmod(fd, 0o600)  # a .tmp left behind keeps its old mode otherwise
        file.write(data)
    os.replace(tmp, path)


def parse_duration(value: Any) -> float:
    """Seconds from a number of seconds or from "90s", "30m", "2h", "1d"; "never" is 0.
    ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        if text in {"never", "off", ""}:
            return 0.0
        found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd]?)", text)
        if not found:
            raise ValueError(value)
        seconds = float(found[1]) * _UNIT_SECONDS[found[2] or "s"]
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(value)
    return seconds


# --- helpers ----------------------------------------------------------------------------

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MODEL_KEYS = ("name", "path", "aliases", "ctx_size", "parallel", "n_gpu_layers", "threads",
               "extra_args", "rpc", "pinned", "idle_ttl", "embeddings", "chat_template", "preload",
               "isolated", "placement")
_UPSTREAM_KEYS = ("url", "api_key", "api_key_file", "kv_layout")
_TOP_KEYS = ("default_model", "memory_limit_mib", "model", "upstream")


def _written_path(path: str, folder: Path | None) -> str:
    if folder is not None:
        try:
            return str(Path(path).relative_to(folder))
        except ValueError:
            pass
    return path


def _describe_duration(seconds: float) -> str | float:
    if seconds != int(seconds):
        return seconds
    for unit in ("d", "h", "m"):
        if seconds and seconds % _UNIT_SECONDS[unit] == 0:
            return f"{int(seconds) // _UNIT_SECONDS[unit]}{unit}"
    return f"{int(seconds)}s"


def _model_fields(entry: ModelEntry, folder: Path | None) -> list[tuple[str, Any]]:
    """The keys of one [[model]] table: the name and path, then what differs from the defaults."""
    fields: list[tuple[str, Any]] = [("name", entry.name), ("path", _written_path(entry.path, folder))]
    if entry.aliases:
        fields.append(("aliases", list(entry.aliases)))
    settings, default = entry.settings, LoadSettings()
    for key in ("ctx_size", "parallel", "n_gpu_layers", "threads"):
        value = getattr(settings, key)
        if str(value) != str(getattr(default, key)):
            fields.append((key, int(value) if key == "parallel" else value))
    extra = [a for a in settings.extra_args if not (entry.embeddings and a in EMBEDDINGS_SPELLINGS)]
    if extra:
        fields.append(("extra_args", extra))
    if settings.rpc:
        fields.append(("rpc", list(settings.rpc)))
    if settings.chat_template == NO_TEMPLATE:
        fields.append(("chat_template", False))
    elif settings.chat_template:
        fields.append(("chat_template", settings.chat_template
                       if settings.chat_template in BUILT_IN_TEMPLATES
                       else _written_path(settings.chat_template, folder)))
    for key in ("pinned", "embeddings", "preload", "isolated"):
        if getattr(entry, key) != getattr(ModelEntry, key):
            fields.append((key, getattr(entry, key)))
    if entry.idle_ttl:
        fields.append(("idle_ttl", _describe_duration(entry.idle_ttl)))
    if entry.placement:
        fields.append(("placement", entry.placement))
    return fields


def _make_private(path: Path) -> None:
    """The models file holds a key: make it 0600 where others may read it (as the
    settings are), or refuse it when that cannot be done."""
    if os.name == "nt":
        return
    mode = path.stat().st_mode
    if not mode & 0o077:
        return
    try:
        os.chmod(path, mode & 0o700)
    except OSError as exc:
        raise SettingsError(f"The models file {path.name} holds an upstream's key and is readable "
                            f"by other users, and could not be made private ({exc.strerror}): "
                            "chmod 600 it, or keep the key in an api_key_file.") from None
    log.warning("The models file %s holds an upstream's key and was readable by other users; "
                "it is now private (0600).", path.name)


class _Reader:
    """One models file's values, each checked, every complaint naming its line and field."""

    def __init__(self, text: str, source: str, folder: Path) -> None:
        self.source = source
        self.folder = folder
        self._lines = _key_lines(text)

    def config(self, data: Mapping[str, Any]) -> PoolConfig:
        self._unknown(data, _TOP_KEYS, None, 0)
        models = tuple(self._model(i, table) for i, table in enumerate(self._tables(data, "model")))
        upstreams = tuple(self._upstream(i, table)
                          for i, table in enumerate(self._tables(data, "upstream")))
        default = data.get("default_model")
        if default is not None and not isinstance(default, str):
            raise self.error(None, 0, "default_model", f"must be a model's name, not {default!r}")
        limit = data.get("memory_limit_mib", 0)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise self.error(None, 0, "memory_limit_mib",
                             f"must be a whole number of MiB, 0 for the machine's, not {limit!r}")
        try:
            ModelNames((m.named for m in models), describe=lambda i, name: self._describe_model(
                i, models[i], name))
        except SettingsError as exc:
            raise SettingsError(f"{self.source}: {exc}") from None
        check_distinct_upstreams(upstreams, lambda i: f"{upstreams[i].url} ({self.where('upstream', i, 'url')})")
        try:
            return PoolConfig(models, upstreams, default or None, limit)
        except SettingsError as exc:  # the default model is none of them
            raise SettingsError(f"{self.where(None, 0, 'default_model')}: {exc}") from None

    def _describe_model(self, i: int, entry: ModelEntry, name: str) -> str:
        key = "name" if entry.name.casefold() == name.casefold() else "aliases"
        line = self._lines.get(("model", i, key)) or self._lines.get(("model", i, None))
        return f"{entry.name} (model {i + 1}" + (f", line {line})" if line else ")")

    # --- tables -----------------------------------------------------------------------

    def _tables(self, data: Mapping[str, Any], kind: str) -> list[Mapping[str, Any]]:
        tables = data.get(kind, [])
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise self.error(None, 0, kind, f"must be [[{kind}]] tables")
        return tables

    def _model(self, i: int, table: Mapping[str, Any]) -> ModelEntry:
        self._unknown(table, _MODEL_KEYS, "model", i)
        raw_path = table.get("path")
        if not isinstance(raw_path, str) or not raw_path.strip():
            raise self.error("model", i, "path" if "path" in table else None,
                             "needs path = the GGUF file to load")
        path = os.path.normpath(self.folder / Path(raw_path).expanduser())
        name = table.get("name")
        if name is not None and not isinstance(name, str):
            raise self.error("model", i, "name", f"must be text, not {name!r}")
        values: dict[str, Any] = {
            "aliases": self._strings("model", i, table, "aliases", split=False),
            "pinned": self._flag("model", i, table, "pinned", False),
            "embeddings": self._flag("model", i, table, "embeddings", False),
            "preload": self._flag("model", i, table, "preload", True),
            "isolated": self._flag("model", i, table, "isolated", False),
        }
        if "placement" in table:
            try:
                values["placement"] = check_placement(table["placement"])
            except SettingsError:
                raise self.error("model", i, "placement", f"must be one of {', '.join(PLACEMENTS)}, "
                                 f"not {table['placement']!r}") from None
        if "idle_ttl" in table:
            try:
                values["idle_ttl"] = parse_duration(table["idle_ttl"])
            except ValueError:
                raise self.error("model", i, "idle_ttl", "must be seconds or a duration like "
                                 f"\"90s\", \"30m\", \"2h\" (0: never), not {table['idle_ttl']!r}") from None
        ctx_size = self._whole("model", i, table, "ctx_size", "tokens, 0 for the model's own")
        parallel = self._parallel(i, table)
        threads = self._whole("model", i, table, "threads", "threads, 0 for every core but one")
        extra_args = self._strings("model", i, table, "extra_args", split=True)
        try:
            rpc = parse_rpc_workers(table.get("rpc", ()))
        except SettingsError as exc:
            raise self.error("model", i, "rpc", str(exc)) from None
        chat_template = self._chat_template(i, table)
        try:
            settings = LoadSettings(ctx_size=ctx_size, parallel=parallel, threads=threads,
                                    n_gpu_layers=table.get("n_gpu_layers", "auto"), extra_args=extra_args,
                                    rpc=rpc, chat_template=chat_template)
        except SettingsError as exc:
            raise self.error("model", i, "n_gpu_layers", str(exc)) from None
        try:
            settings.validate()  # parallel is checked above: what is left is extra_args
        except SettingsError as exc:
            raise self.error("model", i, "extra_args", str(exc)) from None
        try:
            return ModelEntry.for_file(path, name or None, settings=settings, **values)
        except SettingsError as exc:
            raise SettingsError(f"{self.where('model', i, None)}: {exc}") from None

    def _upstream(self, i: int, table: Mapping[str, Any]) -> UpstreamEntry:
        self._unknown(table, _UPSTREAM_KEYS, "upstream", i)
        url = table.get("url")
        if not isinstance(url, str):
            raise self.error("upstream", i, "url" if "url" in table else None,
                             "needs url = the engine's address, like http://host:8080")
        for key in ("api_key", "api_key_file", "kv_layout"):
            if key in table and not isinstance(table[key], str):
                raise self.error("upstream", i, key, f"must be text, not {table[key]!r}")
        if "api_key" in table and "api_key_file" in table:
            raise self.error("upstream", i, "api_key_file", "and api_key are both given: keep one")
        try:
            layout = KvLayout.parse(table.get("kv_layout"))
        except SettingsError:
            raise self.error("upstream", i, "kv_layout", "must be \"split\" or \"unified\", not "
                             f"{table['kv_layout']!r}") from None
        try:
            if "api_key_file" in table:
                return UpstreamEntry.with_key_file(url, self.folder / Path(table["api_key_file"]).expanduser(),
                                                   layout)
            return UpstreamEntry(url, table.get("api_key"), layout)
        except SettingsError as exc:
            key = "api_key_file" if "key file" in str(exc) else "api_key" if "key" in str(exc) else "url"
            raise self.error("upstream", i, key, str(exc)) from None

    # --- values -----------------------------------------------------------------------

    def _whole(self, kind: str, i: int, table: Mapping[str, Any], key: str, unit: str) -> int:
        value = table.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(kind, i, key, f"must be a whole number of {unit}, not {value!r}")
        whole: int = value
        return whole

    def _parallel(self, i: int, table: Mapping[str, Any]) -> str:
        value = table.get("parallel", "auto")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return str(value)
        if value == "auto":
            return "auto"
        raise self.error("model", i, "parallel", f"must be \"auto\" or a number of slots, not {value!r}")

    def _chat_template(self, i: int, table: Mapping[str, Any]) -> str:
        """The model's chat template: true (its own), false (none), a built-in template's
        name or a Jinja file (relative to this file's folder)."""
        value = table.get("chat_template", True)
        if isinstance(value, bool):
            return OWN_TEMPLATE if value else NO_TEMPLATE
        if not isinstance(value, str):
            raise self.error("model", i, "chat_template", "must be true (the model's own), false "
                             "(none), a built-in template's name or a template file, not "
                             f"{value!r}")
        pick = resolved_chat_template(value, self.folder)
        try:
            check_chat_template(pick, as_given=value)
        except SettingsError as exc:
            raise self.error("model", i, "chat_template", str(exc)) from None
        return pick

    def _flag(self, kind: str, i: int, table: Mapping[str, Any], key: str, default: bool) -> bool:
        value = table.get(key, default)
        if not isinstance(value, bool):
            raise self.error(kind, i, key, f"must be true or false, not {value!r}")
        return value

    def _strings(self, kind: str, i: int, table: Mapping[str, Any], key: str, *,
                 split: bool) -> tuple[str, ...]:
        value = table.get(key, [])
        if isinstance(value, str):
            if not split:
                return (value,)
            try:
                return tuple(shlex.split(value))
            except ValueError as exc:
                raise self.error(kind, i, key, f"cannot be read: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(kind, i, key, f"must be a list of texts, not {value!r}")
        return tuple(value)

    def _unknown(self, table: Mapping[str, Any], known: tuple[str, ...], kind: str | None,
                 i: int) -> None:
        for key in table:
            if key not in known:
                raise self.error(kind, i, key, f"is not a setting here (known: {', '.join(known)})")

    # --- where ------------------------------------------------------------------------

    def where(self, kind: str | None, i: int, key: str | None) -> str:
        """"models.toml line 7 (model 2, ctx_size)": the key's line where the file has
        one, else its table's."""
        line = self._lines.get((kind, i, key)) or self._lines.get((kind, i, None))
        at = f"{self.source} line {line}" if line else self.source
        what = [f"{kind} {i + 1}"] if kind else []
        if key:
            what.append(key)
        return f"{at} ({', '.join(what)})" if what else at

    def error(self, kind: str | None, i: int, key: str | None, problem: str) -> SettingsError:
        return SettingsError(f"{self.where(kind, i, key)}: {problem.rstrip('.')}.")


_TABLE_ARRAY = re.compile(r"\s*\[\[\s*([A-Za-z0-9_-]+)\s*\]\]\s*(#.*)?$")
_TABLE = re.compile(r"\s*\[")
_KEY = re.compile(r"\s*([A-Za-z0-9_-]+|\"[^\"]*\")\s*=")


def _key_lines(text: str) -> dict[tuple[str | None, int, str | None], int]:
    """(table kind, index, key) -> the line (1-based) it is on, for the shapes people
    write: top-level keys and [[model]] / [[upstream]] tables (key None: the header)."""
    found: dict[tuple[str | None, int, str | None], int] = {}
    counts: dict[str, int] = {}
    table: tuple[str | None, int] | None = (None, 0)
    for number, line in enumerate(text.splitlines(), 1):
        header = _TABLE_ARRAY.match(line)
        if header:
            kind = header[1]
            counts[kind] = counts.get(kind, -1) + 1
            table = (kind, counts[kind])
            found.setdefault((*table, None), number)
        elif _TABLE.match(line):
            table = None
        elif table is not None and (key := _KEY.match(line)):
            found.setdefault((*table, key[1].strip('"')), number)
    return found
