"""Every room says what it holds: each module and sub-room of a package is named in its
`__init__.py` docstring, in backquotes (`name`, or its dotted path), so that the next
engineer finds a module from the room's description and a new module is described where
it lands.  The window (`studio`) is not held to it yet."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backend", "launcher")


def test_every_module_is_named_in_its_rooms_docstring() -> None:
    unnamed = [f"{_dotted(room)} does not name {member}" for room in _rooms()
               for member in _members(room) if not _names(room, member)]
    assert unnamed == []


def test_every_room_has_a_docstring() -> None:
    bare = [_dotted(room) for room in _rooms()
            if not ast.get_docstring(ast.parse((room / "__init__.py").read_text()))]
    assert bare == []


def _rooms() -> list[Path]:
    return sorted(init.parent for package in PACKAGES
                  for init in (ROOT / package).rglob("__init__.py"))


def _members(room: Path) -> list[str]:
    """The modules (`__main__` aside: running it is its whole point) and sub-rooms."""
    modules = [p.stem for p in room.glob("*.py") if p.stem not in ("__init__", "__main__")]
    rooms = [p.name for p in room.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + rooms)


def _names(room: Path, member: str) -> bool:
    docstring = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
    spelled = (re.escape(member), re.escape(f"{_dotted(room)}.{member}"))
    return any(re.search(rf"`{name}`", docstring) for name in spelled)


def _dotted(room: Path) -> str:
    return ".".join(room.relative_to(ROOT).parts)
