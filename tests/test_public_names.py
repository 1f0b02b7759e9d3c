"""Every module's public names are its own: each name in an `__all__` exists after import,
and a class or function listed there is defined in that module, so that its `__all__`
says where a name lives (an import from elsewhere is not listed again)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import get_origin

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backend", "studio", "launcher")
#: (module, name) listed in a module's `__all__` though defined elsewhere, and why.
RE_EXPORTS: dict[tuple[str, str], str] = {}


def test_every_name_in_an_all_exists_and_is_defined_where_it_is_listed() -> None:
    misplaced = []
    for module_name in _modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            if not hasattr(module, name):
                misplaced.append(f"{module_name}.{name} does not exist")
                continue
            home = _defined_in(getattr(module, name))
            if home not in (None, module_name) and (module_name, name) not in RE_EXPORTS:
                misplaced.append(f"{module_name}.{name} is defined in {home}")
    assert misplaced == []


def test_every_re_export_allowed_is_still_one() -> None:
    stale = []
    for module_name, name in RE_EXPORTS:
        module = importlib.import_module(module_name)
        if name not in getattr(module, "__all__", ()) or _defined_in(getattr(module, name)) in (
                None, module_name):
            stale.append(f"{module_name}.{name}")
    assert stale == []


def _modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue  # running it is its whole point
            if parts[-1] == "__init__":
                parts.pop()
            found.append(".".join(parts))
    return found


def _defined_in(value: object) -> str | None:
    """The module a class or function was defined in; None for other values (constants,
    type aliases), whose home an import cannot tell."""
    if get_origin(value) is not None:  # an alias such as tuple[str, str] or A | B
        return None
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        module = getattr(value, "__module__", None)
        return module if isinstance(module, str) else None
    return None
