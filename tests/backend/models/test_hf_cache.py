"""The cache layout and the checks that keep every path a hub names inside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.errors import UnsafeHubAnswer
from backend.models.hf_cache import (
    check_commit,
    check_file_name,
    check_repo_id,
    hugging_face_cache,
    printable,
    repo_cache,
    repo_id_of_folder,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHA = "ab" * 32


def test_the_layout_is_huggingface_hubs(tmp_path):
    cache = repo_cache("org/Model-GGUF", tmp_path)
    folder = tmp_path / "models--org--Model-GGUF"
    assert cache.folder == folder
    assert cache.blob(SHA) == folder / "blobs" / SHA
    assert cache.incomplete(SHA) == folder / "blobs" / f"{SHA}.incomplete"
    assert cache.lock(SHA) == tmp_path / ".locks" / "models--org--Model-GGUF" / f"{SHA}.lock"
    assert cache.pointer(COMMIT, "Q8_0/M-00001-of-00002.gguf") == \
        folder / "snapshots" / COMMIT / "Q8_0" / "M-00001-of-00002.gguf"
    assert cache.ref() == folder / "refs" / "main"
    assert repo_id_of_folder(folder.name) == "org/Model-GGUF"
    assert repo_id_of_folder("datasets--org--x") is None


def test_the_cache_folder_is_where_huggingface_hub_puts_it():
    home = Path("/home/u")
    assert hugging_face_cache({}, home) == home / ".cache" / "huggingface" / "hub"
    assert hugging_face_cache({"HF_HOME": "/h"}, home) == Path("/h/hub")
    assert hugging_face_cache({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}, home) == Path("/c")


@pytest.mark.parametrize("name", ["", ".", "..", "../x.gguf", "a/../../x.gguf", "/abs.gguf", "a//b.gguf",
                                  "a/./b.gguf", "a\\b.gguf", "C:x.gguf", "a/D:/x.gguf", "x\0.gguf",
                                  "x\n.gguf", "x\u202egguf.exe", "a/"])
def test_file_names_that_are_not_plain_relative_paths_are_refused(name):
    with pytest.raises(UnsafeHubAnswer, match="refused"):
        check_file_name(name)


@pytest.mark.parametrize("name", ["x.gguf", "Q8_0/Big-Q8_0-00001-of-00003.gguf", "..x.gguf", "a..b/c.gguf",
                                  "<b>bold</b>.gguf", "ünïcode.gguf"])
def test_plain_relative_file_names_pass(name):
    assert check_file_name(name) == name


@pytest.mark.parametrize("value", ["main", "../../dir", COMMIT.upper(), COMMIT[:-1], COMMIT + "0", COMMIT + "\n"])
def test_commit_ids_are_forty_lowercase_hex_digits(value):
    with pytest.raises(UnsafeHubAnswer):
        check_commit(value)


@pytest.mark.parametrize("value", ["a", "a/b/c", "../x", "a/..", "a--b/c", "a/b c", "a/b\x1b", "a/" + "x" * 97])
def test_repository_ids_are_owner_slash_name(value):
    with pytest.raises(UnsafeHubAnswer):
        check_repo_id(value)


def test_every_path_is_checked_against_its_folder(tmp_path):
    cache = repo_cache("org/m", tmp_path)
    for blob_id in ("../../victim", "0" * 63, SHA + "/x"):
        with pytest.raises(UnsafeHubAnswer):
            cache.blob(blob_id)
    with pytest.raises(UnsafeHubAnswer):
        cache.pointer(COMMIT, "../" + COMMIT + "x/a.gguf")
    assert cache.blob("1" * 40).name == "1" * 40  # a git blob id names a blob too


def test_text_shown_to_a_person_carries_no_escape_codes():
    assert printable("ok\x1b[2J\x07\u202e") == "ok\\x1b[2J\\x07\\u202e"
    assert printable("x" * 300, 10) == "x" * 9 + "…"
