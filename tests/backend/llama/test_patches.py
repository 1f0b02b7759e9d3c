"""Our patches to the pinned llama.cpp: checked, applied strictly, never to the pinned
sources themselves."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from backend.errors import EngineBuildFailed
from backend.llama.patches import LLAMA_CPP_PATCHES, LlamaPatch, apply_patch, patched_tree

PATCH = """\
Subject: a change, and why

--- a/src/a.c
+++ b/src/a.c
@@ -1,4 +1,5 @@
 int a(void) {
-    return 1;
+    /* two now */
+    return 2;
 }
 
@@ -5,3 +6,3 @@
 int b(void) {
-    return 3;
+    return 4;
 }
"""
SOURCE = "int a(void) {\n    return 1;\n}\n\nint b(void) {\n    return 3;\n}\n"


def small_tree(root: Path, source: str = SOURCE) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.c").write_text(source)
    (root / "CMakeLists.txt").write_text("project(x C)\n")
    return root


def test_a_patch_applies_hunk_by_hunk_at_the_lines_it_names(tmp_path):
    tree = small_tree(tmp_path / "tree")
    assert apply_patch(tree, PATCH, "x.patch") == [(tree / "src" / "a.c").resolve()]
    assert (tree / "src" / "a.c").read_text() == (
        "int a(void) {\n    /* two now */\n    return 2;\n}\n\nint b(void) {\n    return 4;\n}\n")


@pytest.mark.parametrize("source, line", [
    (SOURCE.replace("return 1", "return 9"), 1),  # a removed line differs
    (SOURCE.replace("int b", "long b"), 5),  # a context line differs
    ("\n" + SOURCE, 1),  # the same lines elsewhere: no fuzz, no offset
])
def test_a_patch_that_does_not_match_the_sources_fails_naming_the_file_and_line(tmp_path, source,
                                                                                  line):
    tree = small_tree(tmp_path / "tree", source)
    with pytest.raises(EngineBuildFailed, match=f"x.patch does not apply.*src/a.c differs at "
                                                f"line {line}"):
        apply_patch(tree, PATCH, "x.patch")


def test_a_patch_naming_a_file_outside_the_sources_is_refused(tmp_path):
    tree = small_tree(tmp_path / "tree")
    (tmp_path / "outside.c").write_text(SOURCE)
    with pytest.raises(EngineBuildFailed, match="which the pinned sources do not have"):
        apply_patch(tree, PATCH.replace("b/src/a.c", "b/../outside.c"), "x.patch")
    assert (tmp_path / "outside.c").read_text() == SOURCE


def test_a_patch_file_that_is_not_the_pinned_one_is_refused():
    shipped = LLAMA_CPP_PATCHES[0]
    assert shipped.text().startswith("From: GGUF Studio")
    with pytest.raises(EngineBuildFailed, match="failed its hash check"):
        LlamaPatch(shipped.name, "0" * 64).text()


def test_the_patched_tree_is_a_copy_beside_the_sources_which_stay_as_they_were(tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(LlamaPatch, "text", lambda self: PATCH)
    tree = small_tree(tmp_path / "vendor" / "llama.cpp")
    patches = (LlamaPatch("x.patch", "1" * 64),)
    patched = patched_tree(tree, patches)
    assert patched.parent == tree.parent and patched != tree
    assert (tree / "src" / "a.c").read_text() == SOURCE
    assert "return 4;" in (patched / "src" / "a.c").read_text()
    # Files no patch touches are shared with the sources (hard links), the patched one not.
    assert os.path.samefile(tree / "CMakeLists.txt", patched / "CMakeLists.txt")
    assert not os.path.samefile(tree / "src" / "a.c", patched / "src" / "a.c")
    # Made once: a second build finds it; another set of patches gets its own copy.
    assert patched_tree(tree, patches) == patched
    assert patched_tree(tree, (LlamaPatch("x.patch", "2" * 64),)) != patched
    assert patched_tree(tree, ()) == tree
    assert sorted(p.name for p in tree.parent.iterdir() if p.name.startswith(".")) == []


def test_the_shipped_patches_apply_to_the_pinned_sources(source_tree, tmp_path):
    """Each file the shipped patches change, copied from the pinned sources, takes them;
    the pinned sources are not touched."""
    copy = tmp_path / "llama.cpp"
    touched = ["tools/server/server-context.cpp", "tools/server/server-task.h",
               "tools/server/server-task.cpp", "tools/server/README.md"]
    before = {name: (source_tree / name).read_bytes() for name in touched}
    for name in touched:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_tree / name, copy / name)
    changed = []
    for patch in LLAMA_CPP_PATCHES:
        changed += apply_patch(copy, patch.text(), patch.name)
    assert {p.relative_to(copy.resolve()).as_posix() for p in changed} == set(touched)
    server = (copy / "tools/server/server-context.cpp").read_text()
    assert "slot_checkpoints_append" in server and "slot_checkpoints_read" in server
    assert "update_cache = update_cache && !ret->is_processing();" in server
    cache = (copy / "tools/server/server-task.cpp").read_text()
    assert "const bool keep = lcp_it_best < (int) it_best->prompt.tokens.size();" in cache
    assert "create_checkpoint_at_completion_end(slot);\n                slot.release();" in server
    assert {name: (source_tree / name).read_bytes() for name in touched} == before
