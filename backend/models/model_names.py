"""The names a model answers to, and the one rule that keeps them apart.

A model answers to its name, its aliases, and the names its file gives it
(`file_names`: the file name with and without .gguf, without a split file's
-00001-of-00003, and `owner/repo:QUANT` for a file in the Hugging Face cache).  The
models file (`backend.app.pool.models_file`) and the pool (`backend.app.pool.pool`, which the
window's loads and additions go through) ask one `ModelNames`, so what the file accepts
the pool serves:

- names compare regardless of case, an exact spelling first;
- a name or alias given to two models is an error naming both (where the models file
  has them: their lines), never a traceback;
- a name a file gives its model that another model is given, or that two models' files
  give, answers for neither: each is asked for by its own names;
- `default` (`DEFAULT_MODEL_ALIAS`) is the default model, whichever file that is now:
  a client configured with it keeps working when the owner loads another model.  A
  model given that name itself keeps it (the operator said so);
- the models an engine elsewhere lists (`guests`) are named by that engine and cannot
  be refused here: a guest with a local model's name is that model (their engines serve
  it together); a name another model already has stays that model's.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Callable, Iterable

from backend.errors import SettingsError
from backend.models.hf_cache import printable, repo_id_of_folder
from backend.models.hub import quantization_of

__all__ = ["DEFAULT_MODEL_ALIAS", "MAX_NAME_LENGTH", "ModelNames", "NamedModel", "check_name",
           "file_names", "model_name"]

#: The name of the default model that survives a model swap (see the module docstring).
DEFAULT_MODEL_ALIAS = "default"
MAX_NAME_LENGTH = 256


@dataclass(frozen=True)
class NamedModel:
    """One model as naming sees it."""

    name: str  #: its own name, the one the pool keys it by
    aliases: tuple[str, ...] = ()  #: other names it was given
    path: str | None = None  #: its file, whose names it answers to too; None: an engine elsewhere's

    def file_names(self) -> tuple[str, ...]:
        return file_names(self.path) if self.path else ()

    def describe(self) -> str:
        """How a clash names it: "coder (qwen.gguf)"."""
        return f"{self.name} ({PurePath(self.path).name})" if self.path else self.name


class ModelNames:
    """Every name a request may use, each to one model.  Raises SettingsError when two
    `models` are given one name; `describe(index, name)` says which model of `models`
    and where (else `NamedModel.describe`)."""

    def __init__(self, models: Iterable[NamedModel], *, guests: Iterable[NamedModel] = (),
                 describe: Callable[[int, str], str] | None = None) -> None:
        self._models = tuple(models)
        self._exact: dict[str, str] = {}  # a name as spelled -> its model's name
        self._folded: dict[str, str] = {}  # a name case-folded -> its model's name
        given: dict[str, int] = {}
        for i, model in enumerate(self._models):
            for name in (model.name, *model.aliases):
                first = given.setdefault(name.casefold(), i)
                if first != i:
                    what = describe or (lambda j, _name: self._models[j].describe())
                    raise SettingsError(f"The name {printable(name, 80)!r} is given to two models: "
                                        f"{what(first, name)} and {what(i, name)}.")
                self._claim(name, model.name)
        for guest in guests:
            if guest.name in self._exact and self._exact[guest.name] != guest.name:
                continue  # another model's alias: that model's
            self._exact.setdefault(guest.name, guest.name)  # its own spelling, whatever the case
            for name in (guest.name, *guest.aliases):
                self._claim(name, guest.name)
        claims: dict[str, set[str]] = {}
        for model in self._models:
            for name in model.file_names():
                if name.casefold() not in self._folded and name.casefold() != DEFAULT_MODEL_ALIAS:
                    claims.setdefault(name.casefold(), set()).add(model.name)
        for model in self._models:
            for name in model.file_names():
                if len(claims.get(name.casefold(), ())) == 1:
                    self._claim(name, model.name)

    def resolve(self, name: str) -> str | None:
        """The name of the model `name` asks for: exactly as spelled, else regardless of
        case; None when no model answers to it (the default alias included: see
        `is_default_alias`)."""
        return self._exact.get(name) or self._folded.get(name.casefold())

    def is_default_alias(self, name: str) -> bool:
        """Whether `name` means the default model rather than a model of that name."""
        return name.casefold() == DEFAULT_MODEL_ALIAS and self.resolve(name) is None

    def names_of(self, model: str) -> tuple[str, ...]:
        """Every name that reaches `model`: its own first, then its aliases, then its
        file's (those no other model has)."""
        found = [n for n, owner in self._exact.items() if owner == model]
        return tuple(sorted(found, key=lambda n: n != model))  # stable: its own name first

    def _claim(self, name: str, model: str) -> None:
        if self._folded.setdefault(name.casefold(), model) == model:
            self._exact.setdefault(name, model)


def check_name(name: Any, what: str) -> None:
    """A name or alias a model may be given: printable text, no spaces around it."""
    if not isinstance(name, str) or not name.strip():
        raise SettingsError(f"{what} must be some text, not {name!r}.")
    if name != name.strip() or any(not c.isprintable() for c in name) or len(name) > MAX_NAME_LENGTH:
        raise SettingsError(f"{what} “{printable(name, 80)}” must be printable, without spaces "
                            f"around it, at most {MAX_NAME_LENGTH} characters.")


def model_name(path: str | os.PathLike[str]) -> str:
    """The name a file gives a model: its file name without .gguf, and for a split
    model without the part's -00001-of-00003."""
    return file_names(path)[0]


def file_names(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """Every name the file at `path` gives its model: the file name without .gguf
    (first without a split's part number, then with it), the file name itself, and
    `owner/repo:QUANT` for a file in the Hugging Face cache
    (`models--owner--repo/snapshots/<commit>/...`)."""
    return _file_names(os.fspath(path))


# --- helpers ----------------------------------------------------------------------------

_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}$", re.IGNORECASE)


@functools.lru_cache(maxsize=1024)  # asked on every request's routing, for every model
def _file_names(path: str) -> tuple[str, ...]:
    pure = PurePath(path)
    stem = pure.name[:-5] if pure.name.lower().endswith(".gguf") else pure.name
    names = [_SPLIT_PART.sub("", stem) or stem, stem, pure.name]
    repo, quant = _hf_repo(pure), quantization_of(pure.name)
    if repo and quant:
        names.append(f"{repo}:{quant}")
    return tuple(dict.fromkeys(names))


def _hf_repo(path: PurePath) -> str | None:
    parts = path.parts
    for i in range(len(parts) - 3):
        repo = repo_id_of_folder(parts[i])
        if repo and parts[i + 1] == "snapshots":
            return repo
    return None
