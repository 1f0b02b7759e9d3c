"""Our patches to the pinned llama.cpp: which, checked how, and applied where.

Each patch is a unified diff in `backend/data/llama-cpp-patches/`, headed by what it
changes and why (written to be offered upstream), and pinned here by its SHA-256: a patch
file that is not the pinned one is refused before it touches anything.  Patches apply
strictly: every hunk at the line it names, its context and removed lines exactly as the
pinned sources have them, no fuzz; a hunk that does not match fails the build and names
the file and line.

The unpacked sources stay as the sdist has them (the tests read models and vocabularies
from them); a patched tree is their copy, made once per set of patches beside them in
the cache (files hard-linked where the disk allows, each patched file written anew, so
the original is never touched), under a name of its own that appears only once it is
whole.  The set's digests are part of the engine's build key
(`backend.llama.engine.BuildKey.patches`), so an engine built without a patch, or with
another version of it, is another engine.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from backend.errors import EngineBuildFailed

__all__ = ["LLAMA_CPP_PATCHES", "LlamaPatch", "apply_patch", "patched_tree"]


@dataclass(frozen=True)
class LlamaPatch:
    """One patch file of `backend/data/llama-cpp-patches/` and its pinned SHA-256."""

    name: str
    sha256: str

    @property
    def key(self) -> str:
        """How the build key names it."""
        return f"patch:{self.name}:{self.sha256}"

    def text(self) -> str:
        """The patch file, once its SHA-256 is the pinned one (EngineBuildFailed if not)."""
        data = resources.files("backend").joinpath(f"data/llama-cpp-patches/{self.name}").read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if got != self.sha256:
            raise EngineBuildFailed(f"The engine patch {self.name} failed its hash check (got "
                                    f"{got[:16]}…); refusing to build with it.")
        return data.decode("utf-8")


#: The patches every engine GGUF Studio builds carries, in the order they apply.
LLAMA_CPP_PATCHES: tuple[LlamaPatch, ...] = (
    # A slot's context checkpoints are kept in its save file: without them a parked slot
    # of a sliding-window or hybrid model restores and is then computed again in full.
    LlamaPatch("0001-server-keep-context-checkpoints-in-slot-save-files.patch",
               "633275fe5db3e337ff803d20c658a2c79b54cf4a9db5240535988d0ad3f26994"),
    # A request pinned to a slot that is busy (the port's guess of where an unpinned
    # request went was wrong) swapped that slot's prompt under its running task: its
    # session's prefix lost, and at worst the engine looping for ever.
    LlamaPatch("0002-server-leave-a-busy-slots-prompt-cache-alone.patch",
               "a078745a89ae82676a41a6afcbe608db57c5d54a90b95694e05ed027feac7d81"),
    # A turn that shares only the head of another session's cached prompt took that
    # prompt out of the RAM cache and computed over it: the other session lost its prefix.
    LlamaPatch("0003-server-keep-a-partly-shared-cached-prompt-in-the-cache.patch",
               "1fc0f2543fcce778964bf6a5ad2b91d72483b0cfbe9225954c0283d13987bdc7"),
    # A slot takes a context checkpoint where each completion ends: without it the next
    # turn on a sliding-window model whose prompt came back from the RAM cache or a
    # parked file rolled back to before the last reply and computed the reply again.
    LlamaPatch("0004-server-checkpoint-the-end-of-a-completion.patch",
               "73c284ae2b5c1ec30a00bed00a8ff41adf3dec2ba44e475b2a728ab8fc14719d"),
)


def patched_tree(tree: Path, patches: tuple[LlamaPatch, ...]) -> Path:
    """`tree` (the pinned sources) with `patches` applied: `tree` itself when there are
    none, else its patched copy beside it (made once; see the module's doc)."""
    if not patches:
        return tree
    digest = hashlib.sha256("\n".join(p.key for p in patches).encode()).hexdigest()[:12]
    dest = tree.parent / f"{tree.name}-patched-{digest}"
    if (dest / "CMakeLists.txt").is_file():
        return dest
    texts = [(patch.name, patch.text()) for patch in patches]  # all checked before any copy
    staging = Path(tempfile.mkdtemp(dir=tree.parent, prefix=".patching-"))
    try:
        copy = staging / "tree"
        shutil.copytree(tree, copy, symlinks=True, copy_function=_link_or_copy)
        for name, text in texts:
            apply_patch(copy, text, name)
        if dest.exists():  # a leftover of a copy cut short never holds CMakeLists.txt
            shutil.rmtree(dest)
        os.replace(copy, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def apply_patch(tree: Path, text: str, name: str = "the patch") -> list[Path]:
    """Apply unified diff `text` to the files under `tree`, strictly (see the module's
    doc); the files changed.  Each is written anew (a hard link to the pinned sources is
    replaced, never written through).  EngineBuildFailed, naming `name`, the file and the
    line, when a hunk does not match; files changed before that stay changed."""
    changed = []
    for path, hunks in _file_diffs(text, name):
        target = _inside(tree, path, name)
        try:
            lines = target.read_text("utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError) as exc:
            raise EngineBuildFailed(f"The engine patch {name} does not apply: {path} cannot "
                                    f"be read ({exc}).") from None
        lines = _apply_hunks(lines, hunks, path, name)
        replacement = target.with_name(target.name + ".patched")
        replacement.write_text("".join(lines), "utf-8", newline="")
        shutil.copymode(target, replacement)
        os.replace(replacement, target)
        changed.append(target)
    return changed


# --- helpers ----------------------------------------------------------------------------

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class _Hunk:
    old_start: int  #: 1-based line of the pinned file where it starts
    old: tuple[str, ...]  #: its context and removed lines, as the pinned file has them
    new: tuple[str, ...]  #: its context and added lines


def _file_diffs(text: str, name: str) -> list[tuple[str, list[_Hunk]]]:
    """(path under the tree, its hunks) for each file the diff changes; what comes before
    the first `--- ` line is the patch's description."""
    lines = text.splitlines(keepends=True)
    files: list[tuple[str, list[_Hunk]]] = []
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines)
                and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        path = lines[i + 1][4:].strip().split("\t")[0]
        if not path.startswith("b/"):
            raise EngineBuildFailed(f"The engine patch {name} names {path!r}, not b/PATH.")
        hunks: list[_Hunk] = []
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            match = _HUNK.match(lines[i])
            if match is None:
                raise EngineBuildFailed(f"The engine patch {name} has a malformed hunk "
                                        f"header: {lines[i].strip()!r}.")
            old_count = int(match.group(2) or 1)
            new_count = int(match.group(4) or 1)
            old: list[str] = []
            new: list[str] = []
            i += 1
            while len(old) < old_count or len(new) < new_count:
                if i >= len(lines):
                    raise EngineBuildFailed(f"The engine patch {name} ends inside a hunk of {path}.")
                line = lines[i]
                mark, body = line[:1], line[1:]
                if mark == " ":
                    old.append(body)
                    new.append(body)
                elif mark == "-":
                    old.append(body)
                elif mark == "+":
                    new.append(body)
                elif line.startswith("\\"):
                    pass  # "\ No newline at end of file"
                else:
                    raise EngineBuildFailed(f"The engine patch {name} has a malformed line in "
                                            f"a hunk of {path}: {line.rstrip()!r}.")
                i += 1
            hunks.append(_Hunk(int(match.group(1)), tuple(old), tuple(new)))
        if not hunks:
            raise EngineBuildFailed(f"The engine patch {name} changes {path} with no hunk.")
        files.append((path[2:], hunks))
    if not files:
        raise EngineBuildFailed(f"The engine patch {name} changes no file.")
    return files


def _apply_hunks(lines: list[str], hunks: list[_Hunk], path: str, name: str) -> list[str]:
    out: list[str] = []
    at = 0  # lines of the pinned file consumed
    for hunk in hunks:
        start = max(hunk.old_start - 1, 0) if hunk.old else hunk.old_start
        found = lines[start:start + len(hunk.old)]
        if start < at or [line.rstrip("\r\n") for line in found] != \
                [line.rstrip("\r\n") for line in hunk.old]:
            raise EngineBuildFailed(f"The engine patch {name} does not apply to the pinned "
                                    f"sources: {path} differs at line {hunk.old_start}.")
        out += lines[at:start]
        out += hunk.new
        at = start + len(hunk.old)
    return out + lines[at:]


def _inside(tree: Path, path: str, name: str) -> Path:
    target = (tree / path).resolve()
    if not target.is_relative_to(tree.resolve()) or not target.is_file():
        raise EngineBuildFailed(f"The engine patch {name} names {path}, which the pinned "
                                "sources do not have.")
    return target


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the disk allows (the copy of a 176 MB tree costs nothing), else
    a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
