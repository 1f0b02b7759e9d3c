"""`gguf-studio search` and `pull` as a user runs them, against a local Hugging Face endpoint."""

from __future__ import annotations

import os
from pathlib import Path

from backend.models.download import repo_folder
from tests.backend.app.test_cli import cli
from tests.conftest import BROKEN_REPO, CODER_REPO, GATED_REPO


def user_env() -> dict:
    # hf_hub has pointed HF_ENDPOINT, HF_HOME and the config dir at the test's own.
    return dict(os.environ)


def test_search_lists_repositories_and_without_words_the_curated_models(hf_hub):
    out = cli("search", "tiny", env=user_env())
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(CODER_REPO) and "900 downloads" in lines[0]
    curated = cli("search", env=user_env())
    assert "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF" in curated.stdout
    assert hf_hub.served == []  # the curated list needs no network


def test_pull_downloads_with_a_progress_bar_then_the_model_serves(hf_hub, llama_server_binary):
    out = cli("pull", f"{CODER_REPO}:Q8_0", env=user_env())
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"{CODER_REPO}: Tiny-Coder-Q8_0 (Q8_0, 16.6 MiB) - fits in RAM")
    assert "Needs about" in lines[1]
    bars = [line for line in lines if line.startswith("[")]
    assert len(bars) >= 3 and "100.0%" in bars[-1]  # a line every 10 % when not a terminal
    assert "verifying SHA-256..." in lines
    path = Path(lines[-2])
    assert path == repo_folder(CODER_REPO) / "snapshots" / hf_hub.repos[CODER_REPO].commit / "Tiny-Coder-Q8_0.gguf"
    assert lines[-1].startswith("Ready: gguf-studio serve --model ")
    served = cli("self-test", str(path), "--llama-server", str(llama_server_binary), env=user_env())
    assert served.returncode == 0, served.stderr

    again = cli("pull", f"{CODER_REPO}:Tiny-Coder-Q8_0.gguf", env=user_env())
    assert again.returncode == 0 and Path(again.stdout.splitlines()[-2]) == path
    assert hf_hub.bytes_served("Tiny-Coder-Q8_0.gguf") == path.stat().st_size  # not fetched again


def test_pull_failures_are_one_readable_line(hf_hub):
    gated = cli("pull", GATED_REPO, env=user_env())
    assert gated.returncode == 1
    assert gated.stderr.startswith(f"gguf-studio: {GATED_REPO} is gated")
    assert "Traceback" not in gated.stderr and hf_hub.url not in gated.stderr

    broken = cli("pull", BROKEN_REPO, env=user_env())
    assert broken.returncode == 1 and "does not match the SHA-256" in broken.stderr
    assert not (repo_folder(BROKEN_REPO) / "snapshots").exists()

    unknown = cli("pull", f"{CODER_REPO}:Q2_K", env=user_env())
    assert unknown.returncode == 1 and "Available: Q4_K_M, Q8_0" in unknown.stderr


def test_hub_strings_reach_the_terminal_without_escape_codes(hf_hub, coder_models):
    from tests.hf_endpoint import HubRepo

    q4 = coder_models["Tiny-Coder-Q4_K_M.gguf"]
    hf_hub.repos["test-org/Tiny\x1b[31mRed-GGUF"] = HubRepo("test-org/Tiny\x1b[31mRed-GGUF", {"x.gguf": q4})
    hf_hub.repos["test-org/Tiny-Title-GGUF"] = HubRepo(
        "test-org/Tiny-Title-GGUF", {"Tiny\x1b]0;owned\x07-Q4_K_M.gguf": q4})
    hf_hub.repos["test-org/Tiny-Date-GGUF"] = HubRepo(
        "test-org/Tiny-Date-GGUF", {"x.gguf": q4}, last_modified="2026\x1b]0;x\x07-11-01")
    found = cli("search", "tiny", env=user_env())
    assert found.returncode == 0, found.stderr
    assert "\x1b" not in found.stdout and "\x07" not in found.stdout
    assert "Red-GGUF" not in found.stdout  # not a repository id: left out
    assert "test-org/Tiny-Date-GGUF" in found.stdout and "2026\\x1b]0" in found.stdout

    pulled = cli("pull", "test-org/Tiny-Title-GGUF", env=user_env())
    assert pulled.returncode == 1
    assert "\x1b" not in pulled.stdout + pulled.stderr and "\x07" not in pulled.stdout + pulled.stderr
    assert pulled.stderr.startswith("gguf-studio: Hugging Face named a file “Tiny\\x1b]0;owned\\x07-Q4_K_M.gguf”")
    assert not repo_folder("test-org/Tiny-Title-GGUF").exists()
