"""`serve`'s flags and the models file, as the pool configuration they make: several
models and upstreams, each with its key and layout, and the single forms as before."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from backend.app import cli
from backend.app.pool.pool_config import PoolConfig
from backend.errors import SettingsError, StudioError
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSettings
from tests.backend.app.test_cli import ROOT, cli as run_cli
from tests.not_none import not_none


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user with no saved settings and no GGUF_STUDIO_* variables; works in tmp_path."""
    for name in list(os.environ):
        if name.startswith("GGUF_STUDIO_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def serve_config(*argv: str) -> PoolConfig:
    args = cli._parser().parse_args(["serve", *argv])
    return cli.pool_config(args, cli.serve_settings(args))


def test_every_model_flag_is_a_model_with_the_flags_load_settings(user):
    config = serve_config("--model", "coder.gguf", "--model", "small.gguf", "--ctx-size", "8192",
                          "--parallel", "2")
    assert [(m.name, m.path) for m in config.models] == [
        ("coder", str(user / "coder.gguf")), ("small", str(user / "small.gguf"))]
    assert all(m.settings == LoadSettings(ctx_size=8192, parallel="2") for m in config.models)
    assert config.default is config.models[0]


def test_the_chat_template_flag_picks_the_models_template_and_a_file_is_found_from_here(user):
    (user / "templates").mkdir()
    (user / "templates" / "base.jinja").write_text("{{ messages[0]['content'] }}")
    config = serve_config("--model", "base.gguf", "--embeddings-model", "e.gguf",
                          "--chat-template", "templates/base.jinja")
    chat, embed = config.models
    assert chat.settings.chat_template == str(user / "templates" / "base.jinja")
    assert embed.settings.chat_template == ""  # an embeddings model takes no chats
    assert serve_config("--model", "base.gguf", "--chat-template", "ChatML").models[0] \
        .settings.chat_template == "chatml"
    with pytest.raises(SettingsError, match="'chat-ml' is neither"):
        serve_config("--model", "base.gguf", "--chat-template", "chat-ml")


def test_name_equals_path_names_a_model_and_a_file_with_an_equals_sign_stays_a_path(user):
    (user / "odd=name.gguf").write_bytes(b"")
    config = serve_config("--model", "coder=models/qwen.gguf", "--model", "odd=name.gguf",
                          "--embeddings-model", "embed=e.gguf", "--default-model", "coder")
    coder, odd, embed = config.models
    assert (coder.name, coder.path) == ("coder", str(user / "models" / "qwen.gguf"))
    assert config.resolve("qwen") is coder  # the file's name still answers
    assert (odd.name, odd.path) == ("odd=name", str(user / "odd=name.gguf"))
    assert embed.embeddings and embed.settings.extra_args == ("--embeddings",)


def test_the_models_file_and_the_flags_make_one_pool(user):
    (user / "pool.toml").write_text('memory_limit_mib = 8000\n[[model]]\npath = "coder.gguf"\n'
                                    'pinned = true\n[[upstream]]\nurl = "http://box2:8899"\n')
    config = serve_config("--models-file", "pool.toml", "--model", "small.gguf",
                          "--upstream", "http://box3:8080", "--memory-limit", "12000",
                          "--default-model", "small")
    assert [m.name for m in config.models] == ["coder", "small"]
    assert config.models[0].pinned
    assert [u.url for u in config.upstreams] == ["http://box2:8899", "http://box3:8080"]
    assert (config.memory_limit_mib, not_none(config.default).name) == (12000, "small")


def test_the_models_file_may_come_from_the_environment(user, monkeypatch):
    (user / "pool.toml").write_text('[[model]]\npath = "coder.gguf"\n')
    monkeypatch.setenv("GGUF_STUDIO_MODELS_FILE", str(user / "pool.toml"))
    assert [m.name for m in serve_config().models] == ["coder"]


def test_a_name_on_the_command_line_clashing_with_the_file_names_both(user):
    (user / "pool.toml").write_text('[[model]]\npath = "a.gguf"\nname = "coder"\n')
    with pytest.raises(SettingsError, match=r"The name 'coder' is given to two models: "
                       r"coder \(a\.gguf\) and coder \(b\.gguf\)\."):
        serve_config("--models-file", "pool.toml", "--model", "coder=b.gguf")


def test_each_upstream_gets_its_own_key_and_layout_in_the_order_given(user):
    (user / "box1.key").write_text("box1-secret\n")
    config = serve_config("--upstream", "http://box1:8080", "--upstream", "http://box2:8080",
                          "--upstream-api-key-file", "box1.key", "--upstream-api-key-file", "",
                          "--upstream-kv", "split", "--upstream-kv", "unified")
    assert [(u.url, u.api_key, u.kv_layout) for u in config.upstreams] == [
        ("http://box1:8080", "box1-secret", KvLayout.SPLIT), ("http://box2:8080", None, KvLayout.UNIFIED)]
    one_layout = serve_config("--upstream", "http://box1:8080", "--upstream", "http://box2:8080",
                              "--upstream-kv", "split")
    assert [u.kv_layout for u in one_layout.upstreams] == [KvLayout.SPLIT, KvLayout.SPLIT]


@pytest.mark.parametrize("argv, message", [
    (("--upstream", "http://a:1", "--upstream", "http://b:1", "--upstream-api-key", "only-one"),
     "Give one --upstream-api-key per --upstream, in the same order ('' for one that needs none): "
     "2 upstream(s), 1 key(s)."),
    (("--upstream", "http://a:1", "--upstream", "http://b:1", "--upstream-kv", "split",
      "--upstream-kv", "split", "--upstream-kv", "unified"),
     "Give one --upstream-kv for every upstream, or one per --upstream in the same order: "
     "2 upstream(s), 3 layouts."),
    ((), "Give a model with --model PATH, a models file with --models-file FILE, or a running "
         "llama-server with --upstream URL."),
])
def test_keys_and_layouts_that_do_not_pair_with_the_upstreams_are_refused(user, argv, message):
    with pytest.raises(StudioError) as caught:
        serve_config(*argv)
    assert str(caught.value) == message


def test_the_single_forms_work_as_before(user):
    config = serve_config("--upstream", "http://gpu:8080/v1", "--upstream-api-key", "upstream-key",
                          "--upstream-kv", "unified")
    assert config.models == ()
    assert [(u.url, u.api_key, u.kv_layout) for u in config.upstreams] == [
        ("http://gpu:8080", "upstream-key", KvLayout.UNIFIED)]
    single = serve_config("--model", "tiny.gguf", "--threads", "3")
    assert [(m.name, m.settings.threads) for m in single.models] == [("tiny", 3)]


def test_without_flags_the_saved_last_load_is_served_as_before(user, monkeypatch):
    saved = user / "config" / "gguf-studio" / "settings.json"
    saved.parent.mkdir(parents=True)
    saved.write_text(json.dumps({"model": str(user / "last.gguf"), "ctx_size": 4096}))
    assert [(m.name, m.settings.ctx_size) for m in serve_config().models] == [("last", 4096)]
    (user / "up.key").write_text("upstream-secret\n")
    monkeypatch.setenv("GGUF_STUDIO_UPSTREAM", "http://gpu:8080")  # an upstream wins, as before
    config = serve_config("--upstream-api-key-file", "up.key")
    assert config.models == () and config.upstreams[0].api_key == "upstream-secret"


def test_save_remembers_the_first_model_and_the_models_file_as_absolute_paths(user):
    args = cli._parser().parse_args(["serve", "--model", "a.gguf", "--model", "b.gguf",
                                     "--models-file", "pool.toml", "--upstream-kv", "split"])
    settings = cli.serve_settings(args)
    assert (settings.model, settings.models_file, settings.upstream_kv) == (
        str(user / "a.gguf"), str(user / "pool.toml"), "split")


def test_serve_names_every_missing_model_file_before_starting_anything(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    out = run_cli("serve", "--model", str(tiny_model), "--model", f"big={tmp_path / 'big.gguf'}",
                  "--port", "0", env=env)
    assert out.returncode == 1
    assert out.stderr == f"gguf-studio: No GGUF file at {tmp_path / 'big.gguf'} (model big).\n"


def test_serve_with_a_broken_models_file_says_where_in_one_line(tmp_path):
    (tmp_path / "pool.toml").write_text('[[model]]\npath = "a.gguf"\nctx_size = "lots"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    out = run_cli("serve", "--models-file", str(tmp_path / "pool.toml"), env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr == ("gguf-studio: pool.toml line 3 (model 1, ctx_size): must be a whole number "
                          "of tokens, 0 for the model's own, not 'lots'.\n")


def test_serve_with_two_models_answers_each_by_name_and_lists_both(tiny_model, smollm2_model,
                                                                    llama_server_binary, tmp_path):
    """`serve --model A --model NAME=B` as a user runs it: both load side by side, and a
    request reaches the model it names (their answers differ)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_STATE_HOME=str(tmp_path / "state"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "serve", "--model", str(tiny_model),
         "--model", f"smol={smollm2_model}", "--port", "0", "--parallel", "1", "--ctx-size", "2048",
         "--threads", "1", "--llama-server", str(llama_server_binary)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url, ready = "", set()
        for line in not_none(proc.stdout):
            if line.strip().startswith("http://") and not url:
                url = line.strip()
            if line.startswith("[ready] "):
                ready.add(line.split()[1].rstrip(":"))
            if ready == {"tiny", "smol"} or line.startswith("[failed]"):
                break
        assert ready == {"tiny", "smol"}, line
        listed = httpx.get(f"{url}/models").json()["data"]
        assert {"tiny", "smol"} <= {m["id"] for m in listed}
        answers = {}
        for model in ("tiny", "smol"):
            answer = httpx.post(f"{url}/chat/completions", timeout=120, json={
                "model": model, "temperature": 0, "max_tokens": 48,
                "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]})
            assert answer.status_code == 200, answer.text
            answers[model] = answer.json()["choices"][0]["message"]["content"]
        assert "Paris" in answers["smol"] and answers["tiny"] != answers["smol"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        not_none(proc.stdout).close()
        not_none(proc.stderr).close()


def test_serve_says_when_a_model_has_no_chat_template_and_what_its_clients_get(
        gemma3_model, llama_server_binary, tmp_path):
    """The load report of a model without a chat template (the real Gemma 3 270M) says
    that chats are refused and plain prompts taken, and how to pick one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_STATE_HOME=str(tmp_path / "state"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "serve", "--model", f"gemma={gemma3_model}",
         "--port", "0", "--parallel", "1", "--ctx-size", "2048", "--threads", "1",
         "--llama-server", str(llama_server_binary)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = iter(not_none(proc.stdout))
        for line in lines:
            if line.startswith(("[ready] gemma", "[failed]")):
                break
        assert line.startswith("[ready] gemma:"), line
        said = next(lines).strip()
        assert said.startswith("This model has no chat template: chat requests "
                               "(/v1/chat/completions, /v1/responses, /v1/messages) are refused "
                               "with 400 model_has_no_chat_template, and /v1/completions takes "
                               "plain prompts."), said
        assert "serve --chat-template NAME|FILE" in said
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        not_none(proc.stdout).close()
        not_none(proc.stderr).close()


def test_serve_over_a_gguf_studio_port_says_which_of_its_models_load_on_demand(
        tiny_model, llama_server_binary, tmp_path):
    """A model the port behind lists but has not loaded is printed as unloaded there and
    loaded by its first request, not as a stopped engine."""
    from backend.llama.supervisor import pick_free_port
    from tests.backend.llama.test_remote_engine import end_studio, start_studio

    port = pick_free_port()
    inner_home = tmp_path / "inner"
    inner_home.mkdir()
    later = shutil.copy(tiny_model, inner_home / "later.gguf")
    (inner_home / "pool.toml").write_text(
        f'[[model]]\nname = "later"\npath = "{later}"\npreload = false\n')
    inner = start_studio(inner_home, llama_server_binary, tiny_model, port,
                         extra=("--models-file", str(inner_home / "pool.toml"),
                                "--default-model", "tiny"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_STATE_HOME=str(tmp_path / "state"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "serve", "--upstream", f"http://127.0.0.1:{port}",
         "--upstream-api-key", "studio-key-0123456789", "--port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        said: dict[str, str] = {}
        for line in not_none(proc.stdout):
            if line.startswith("["):
                said[line.split()[1].rstrip(":")] = line.strip()
            if said.get("tiny", "").startswith("[ready]") and "later" in said:
                break
        assert said["later"] == "[unloaded] later: unloaded at upstream 1: loaded there by its first request"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        not_none(proc.stdout).close()
        end_studio(inner)


def test_serve_takes_two_models_whose_files_share_a_name_and_answers_each_by_its_own(
        tiny_model, tmp_path):
    """The models file accepts `a/model.gguf` and `b/model.gguf` named a and b; the pool
    serves both (it used to refuse them with a ValueError traceback), and the file name
    they share answers for neither."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        shutil.copy(tiny_model, tmp_path / folder / "model.gguf")
    (tmp_path / "pool.toml").write_text(
        '[[model]]\nname = "a"\npath = "a/model.gguf"\npreload = false\n\n'
        '[[model]]\nname = "b"\npath = "b/model.gguf"\npreload = false\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_STATE_HOME=str(tmp_path / "state"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.app.cli", "serve", "--models-file", str(tmp_path / "pool.toml"),
         "--port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = next((line.strip() for line in not_none(proc.stdout)
                    if line.strip().startswith("http://")), "")
        assert url, not_none(proc.stderr).read()
        assert [m["id"] for m in httpx.get(f"{url}/models").json()["data"]] == ["a", "b", "default"]
        shared = httpx.post(f"{url}/chat/completions", json={
            "model": "model.gguf", "messages": [{"role": "user", "content": "hi"}]})
        assert shared.status_code == 404 and shared.json()["error"]["code"] == "model_not_found"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        not_none(proc.stdout).close()
        not_none(proc.stderr).close()


def test_serve_with_a_name_given_to_two_models_names_both_lines_and_exits(tiny_model, tmp_path):
    (tmp_path / "pool.toml").write_text(
        f'[[model]]\nname = "a"\naliases = ["coder"]\npath = "{tiny_model}"\n\n'
        f'[[model]]\nname = "Coder"\npath = "{tiny_model}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_STUDIO_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    out = run_cli("serve", "--models-file", str(tmp_path / "pool.toml"), "--port", "0", env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr == ("gguf-studio: pool.toml: The name 'Coder' is given to two models: "
                          "a (model 1, line 3) and Coder (model 2, line 7).\n")
