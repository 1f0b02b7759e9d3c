"""Finding models: search, a repository's files, choosing one, the token, readable errors.

Against a local Hugging Face-compatible endpoint (tests/hf_endpoint.py) spoken to by the
real huggingface_hub client; never the network.
"""

from __future__ import annotations

import os
import socket
import stat

import pytest

from backend.errors import HubError, HubNotFound, HubUnreachable
from backend.models.hub import (
    HubFile,
    curated_models,
    current_token,
    group_choices,
    list_repo,
    parse_pull_target,
    pick_choice,
    quantization_of,
    save_token,
    search,
    token_for,
    token_path,
)
from tests.conftest import CODER_REPO


def test_search_finds_gguf_repositories_most_downloaded_first(hf_hub):
    found = search("tiny")
    assert [r.repo_id for r in found] == [CODER_REPO, "test-org/Tiny-Chat-GGUF"]
    assert found[0].downloads == 900 and found[0].last_modified.startswith("2026-11-01")
    assert [r.repo_id for r in search("tiny", sort="recent")][0] == "test-org/Tiny-Chat-GGUF"
    assert search("no such words") == []


def test_a_repository_lists_its_models_by_quantization_with_sizes_and_checksums(hf_hub, coder_models):
    listing = list_repo(CODER_REPO)
    grouped = listing.by_quant()
    assert sorted(grouped) == ["Q4_K_M", "Q8_0"]
    q4 = grouped["Q4_K_M"][0]
    local = coder_models["Tiny-Coder-Q4_K_M.gguf"]
    assert q4.size == local.stat().st_size
    assert q4.files[0].sha256 == hf_hub.repos[CODER_REPO].sha256("Tiny-Coder-Q4_K_M.gguf")
    assert listing.commit == hf_hub.repos[CODER_REPO].commit
    assert listing.gguf_metadata["total"] == 8_000_000


def test_split_parts_are_one_model_and_projectors_are_left_out():
    files = [HubFile(f"Q8_0/Big-Q8_0-0000{i}-of-00003.gguf", 10, f"{i}" * 64) for i in (2, 1, 3)]
    files += [HubFile("Big-Q4_K_M.gguf", 12, "a" * 64), HubFile("mmproj-Big-F16.gguf", 5, "b" * 64),
              HubFile("README.md", 1, ""),
              HubFile("Half-Q2_K-00001-of-00002.gguf", 1, "c" * 64)]  # part 2 missing: not loadable
    choices = group_choices("o/r", files)
    assert [(c.quant, c.size, len(c.files)) for c in choices] == [("Q4_K_M", 12, 1), ("Q8_0", 30, 3)]
    assert choices[1].first_file == "Q8_0/Big-Q8_0-00001-of-00003.gguf"
    assert choices[1].name == "Big-Q8_0"


@pytest.mark.parametrize("name, quant", [
    ("Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
    ("qwen2.5-coder-7b-instruct-q5_k_m-00001-of-00002.gguf", "Q5_K_M"),
    ("Devstral-Small-2507-UD-Q4_K_XL.gguf", "Q4_K_XL"),
    ("Llama-3-8B-IQ2_XXS.gguf", "IQ2_XXS"),
    ("gpt-oss-20b-mxfp4.gguf", "MXFP4"),
    ("model-f16.gguf", "F16"),
    ("model.gguf", ""),
])
def test_quantization_is_read_from_the_file_name(name, quant):
    assert quantization_of(name) == quant


def test_pull_targets_name_a_quantization_or_a_file(hf_hub):
    assert parse_pull_target("o/r") == ("o/r", "")
    assert parse_pull_target("o/r:Q8_0") == ("o/r", "Q8_0")
    with pytest.raises(HubError, match="owner/name"):
        parse_pull_target("just-a-name")
    listing = list_repo(CODER_REPO)
    assert pick_choice(listing).quant == "Q4_K_M"  # llama.cpp's own default
    assert pick_choice(listing, "q8_0").quant == "Q8_0"
    assert pick_choice(listing, "Tiny-Coder-Q8_0.gguf").quant == "Q8_0"
    with pytest.raises(HubNotFound, match="Available: Q4_K_M, Q8_0"):
        pick_choice(listing, "Q2_K")


def test_the_curated_coding_models_ship_with_the_package():
    models = curated_models()
    assert len(models) >= 5
    assert {m.size for m in models} == {"small", "medium", "large"}
    assert all(m.repo_id.count("/") == 1 and m.name for m in models)


def test_an_unknown_repository_is_a_readable_not_found(hf_hub):
    with pytest.raises(HubNotFound) as caught:
        list_repo("test-org/Nothing-Here")
    assert "No repository test-org/Nothing-Here" in str(caught.value)
    assert hf_hub.url not in str(caught.value)


def test_offline_is_a_readable_sentence(hf_hub, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(HubUnreachable, match="cannot be reached"):
        search("tiny")
    with pytest.raises(HubUnreachable, match="cannot be reached"):
        list_repo(CODER_REPO)


def test_a_saved_token_is_private_and_the_environment_wins(hf_hub, monkeypatch, loose_umask):
    assert current_token() is None
    path = save_token("hf_saved\n")
    assert path == token_path()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert current_token() == "hf_saved"
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert current_token() == "hf_from_env"


@pytest.mark.parametrize("endpoint, url, sent", [
    ("https://huggingface.co", "https://huggingface.co/api/models", True),
    ("https://huggingface.co", "https://huggingface.co:443/o/r/resolve/x", True),
    ("https://huggingface.co", "https://cdn-lfs.huggingface.co/x", False),  # another host
    ("https://huggingface.co", "http://huggingface.co/x", False),  # another scheme
    ("https://huggingface.co", "https://huggingface.co:8443/x", False),  # another port
    ("https://mirror.example", "https://huggingface.co/x", False),
    ("http://mirror.example", "http://mirror.example/x", False),  # plain http off this machine
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080/x", True),
    ("http://localhost:8080", "http://localhost:8080/x", True),
    ("http://[::1]:8080", "http://[::1]:8080/x", True),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8081/x", False),
])
def test_the_token_goes_only_to_the_endpoint_itself(monkeypatch, endpoint, url, sent):
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert (token_for(url) == "hf_secret") is sent


def test_the_token_folder_is_private_when_it_is_made(hf_hub, tmp_path, loose_umask):
    save_token("hf_saved")
    assert stat.S_IMODE(os.stat(token_path().parent).st_mode) == 0o700
