"""The models file as an operator writes it: every mistake named by line and field,
names that resolve one way only, keys kept private, and a file written back that reads
the same."""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings as hypothesis_settings, strategies as st

from backend.app.pool.models_file import (models_file_text, parse_duration, parse_models_file,
                                     read_models_file, write_models_file)
from backend.app.pool.pool_config import ModelEntry, PoolConfig, UpstreamEntry
from backend.toml_text import toml_string
from backend.errors import SettingsError
from backend.llama.api import engine_headers
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSettings
from backend.llama.supervisor import Supervisor
from tests.model_factory import EMBEDDING_LENGTH

FULL = """\
# the team's box
default_model = "qwen"
memory_limit_mib = 20000

[[model]]
path = "models/Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf"   # relative to this file
name = "coder"
aliases = ["qwen"]
ctx_size = 32768
parallel = 4
n_gpu_layers = "all"
threads = 6
extra_args = ["--flash-attn", "on"]
pinned = true

[[model]]
path = "/srv/models/nomic-embed-text-v1.5.Q8_0.gguf"
embeddings = true
idle_ttl = "30m"
preload = false

[[upstream]]
url = "http://10.0.0.2:8899/v1/"
api_key_file = "box2.key"
kv_layout = "split"

[[upstream]]
url = "http://10.0.0.3:8080"
"""


def write(folder: Path, text: str, name: str = "models.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def error_of(text: str, folder: Path | None = None) -> str:
    with pytest.raises(SettingsError) as caught:
        parse_models_file(text, folder=folder or Path("/pool"), source="models.toml")
    return str(caught.value)


# --- reading ---------------------------------------------------------------------------

def test_a_models_file_gives_every_model_its_settings_and_every_upstream_its_key(tmp_path):
    (tmp_path / "box2.key").write_text("box2-secret\n")
    config = read_models_file(write(tmp_path, FULL))

    coder, embed = config.models
    assert coder == ModelEntry(
        name="coder", path=str(tmp_path / "models" / "Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf"),
        settings=LoadSettings(ctx_size=32768, parallel="4", n_gpu_layers="all", threads=6,
                              extra_args=("--flash-attn", "on")),
        aliases=("qwen",), pinned=True)
    assert embed.name == "nomic-embed-text-v1.5.Q8_0"  # no name: the file's, without .gguf
    assert (embed.embeddings, embed.idle_ttl, embed.preload, embed.pinned) == (True, 1800.0, False, False)
    assert embed.settings.extra_args == ("--embeddings",)  # how llama-server serves embeddings
    assert config.default is coder and config.memory_limit_mib == 20000
    box2, box3 = config.upstreams
    assert (box2.url, box2.api_key, box2.kv_layout) == ("http://10.0.0.2:8899", "box2-secret", KvLayout.SPLIT)
    assert (box3.url, box3.api_key, box3.kv_layout) == ("http://10.0.0.3:8080", None, None)


def test_requests_find_a_model_by_name_alias_or_file_name_regardless_of_case():
    config = parse_models_file(FULL.replace('api_key_file = "box2.key"\n', ""))
    coder, embed = config.models
    for asked in ("coder", "QWEN", "qwen2.5-coder-7b-instruct-q4_k_m"):
        assert config.resolve(asked) is coder
    assert config.resolve("nomic-embed-text-v1.5.q8_0") is embed
    assert config.resolve("") is coder and config.resolve(None) is coder  # the default
    assert config.resolve("gpt-4o") is None
    assert config.names(coder) == ("coder", "qwen", "Qwen2.5-Coder-7B-Instruct-Q4_K_M",
                                   "Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf")


def test_without_a_default_the_first_chat_model_is_it_not_an_embeddings_model():
    config = parse_models_file('[[model]]\npath = "/m/embed.gguf"\nembeddings = true\n'
                               '[[model]]\npath = "/m/chat.gguf"\n')
    assert config.default is not None and config.default.name == "chat"
    only_embeddings = PoolConfig((ModelEntry.for_file("/m/e.gguf", embeddings=True),))
    assert only_embeddings.default is only_embeddings.models[0]
    assert PoolConfig().default is None


def test_a_default_model_that_is_none_of_the_models_is_refused_unless_an_upstream_may_have_it():
    message = error_of('default_model = "gpt"\n[[model]]\npath = "/m/a.gguf"\n')
    assert message == ("models.toml line 1 (default_model): The default model 'gpt' is none of "
                       "the models: a.")
    # A GGUF Studio upstream lists its models only once it answers.
    config = parse_models_file('default_model = "big"\n[[upstream]]\nurl = "http://h:1"\n')
    assert config.default_model == "big" and config.default is None


# --- names that would answer two ways ------------------------------------------------------

def test_a_name_given_to_two_models_is_an_error_naming_both_with_their_lines():
    message = error_of('[[model]]\npath = "/m/a.gguf"\nname = "coder"\n\n'
                       '[[model]]\npath = "/m/b.gguf"\naliases = ["x", "Coder"]\n')
    assert message == ("models.toml: The name 'Coder' is given to two models: coder (model 1, "
                       "line 3) and b (model 2, line 7).")


def test_a_file_name_two_models_share_answers_for_neither_and_their_own_names_still_do():
    # The same file twice, with two contexts: its file name would be ambiguous.
    config = parse_models_file('[[model]]\npath = "/m/qwen.gguf"\nname = "qwen-short"\nctx_size = 4096\n'
                               '[[model]]\npath = "/m/qwen.gguf"\nname = "qwen-long"\nctx_size = 32768\n')
    assert config.resolve("qwen") is None
    assert config.resolve("qwen-long") is config.models[1]
    assert config.names(config.models[0]) == ("qwen-short",)


# --- every mistake named ---------------------------------------------------------------------

@pytest.mark.parametrize("table, expected", [
    ('ctx_size = "big"', "models.toml line 3 (model 1, ctx_size): must be a whole number of "
                         "tokens, 0 for the model's own, not 'big'."),
    ("ctx_size = -1", "models.toml line 3 (model 1, ctx_size): must be a whole number of tokens, "
                      "0 for the model's own, not -1."),
    ("parallel = 0", "models.toml line 3 (model 1, parallel): must be \"auto\" or a number of slots, not 0."),
    ('n_gpu_layers = "most"', "models.toml line 3 (model 1, n_gpu_layers): GPU layers must be auto, "
                              "all, none or a number, not 'most'."),
    ("threads = 1.5", "models.toml line 3 (model 1, threads): must be a whole number of threads, "
                      "0 for every core but one, not 1.5."),
    ('idle_ttl = "soon"', "models.toml line 3 (model 1, idle_ttl): must be seconds or a duration like "
                          "\"90s\", \"30m\", \"2h\" (0: never), not 'soon'."),
    ('pinned = "yes"', "models.toml line 3 (model 1, pinned): must be true or false, not 'yes'."),
    ("aliases = [1]", "models.toml line 3 (model 1, aliases): must be a list of texts, not [1]."),
    ('extra_args = ["--port", "1"]', "models.toml line 3 (model 1, extra_args): --port cannot be given as "
                                     "extra arguments: GGUF Studio sets the model, host, port, parallel "
                                     "slots, API key, RPC workers, output cap and chat template itself "
                                     "(the chat template is a load setting of its own)."),
    ("chat_template = 3", "models.toml line 3 (model 1, chat_template): must be true (the model's "
                          "own), false (none), a built-in template's name or a template file, not 3."),
    ('chat_template = "gemma-3"', "models.toml line 3 (model 1, chat_template): The chat template "
                                  "'gemma-3' is neither one of llama.cpp's built-in templates "
                                  "(chatml, gemma, llama3, mistral-v7, phi4, ... the Model tab lists "
                                  "them all) nor a readable Jinja template file."),
    ('placement = "sticky"', "models.toml line 3 (model 1, placement): must be one of "
                             "keep-prefixes, hash-ring, not 'sticky'."),
    ("ctx = 4096", "models.toml line 3 (model 1, ctx): is not a setting here (known: name, path, aliases, "
                   "ctx_size, parallel, n_gpu_layers, threads, extra_args, rpc, pinned, idle_ttl, embeddings, "
                   "chat_template, preload, isolated, placement)."),
    ('rpc = ["[::1]:50052"]', "models.toml line 3 (model 1, rpc): RPC worker '[::1]:50052': llama.cpp "
                              "reaches RPC workers over IPv4 only; give an IPv4 address or a host "
                              "name, as host:port."),
    ('name = " padded"', "models.toml line 1 (model 1): A model's name “ padded” must be printable, "
                         "without spaces around it, at most 256 characters."),
    ('pinned = true\nidle_ttl = 60', "models.toml line 1 (model 1): m is pinned, so it is never unloaded "
                                     "and an idle TTL cannot apply: drop one of them."),
])
def test_a_bad_model_value_is_named_by_its_line_and_field(table, expected):
    assert error_of(f'[[model]]\npath = "/m/m.gguf"\n{table}\n') == expected


def test_a_model_without_a_path_says_what_is_missing():
    assert error_of('[[model]]\nname = "x"\n') == \
        "models.toml line 1 (model 1): needs path = the GGUF file to load."


@pytest.mark.parametrize("table, expected", [
    ('url = "ftp://h"', "models.toml line 3 (upstream 1, url): The upstream must be an http(s) URL like "
                        "http://host:8080, not 'ftp://h'."),
    ('url = "http://h:1"\nkv_layout = "shared"',
     "models.toml line 4 (upstream 1, kv_layout): must be \"split\" or \"unified\", not 'shared'."),
    ('url = "http://h:1"\napi_key = "k"\napi_key_file = "k.key"',
     "models.toml line 5 (upstream 1, api_key_file): and api_key are both given: keep one."),
    ('url = "http://h:1"\napi_key_file = "missing.key"',
     "models.toml line 4 (upstream 1, api_key_file): The API key file missing.key cannot be read "
     "(No such file or directory)."),
    ('url = "http://h:1"\nkey = "k"', "models.toml line 4 (upstream 1, key): is not a setting here "
                                      "(known: url, api_key, api_key_file, kv_layout)."),
])
def test_a_bad_upstream_value_is_named_by_its_line_and_field(table, expected):
    assert error_of(f"memory_limit_mib = 0\n[[upstream]]\n{table}\n") == expected


def test_file_level_mistakes_are_named_too():
    assert error_of("memory_limit_mib = -5\n") == \
        "models.toml line 1 (memory_limit_mib): must be a whole number of MiB, 0 for the machine's, not -5."
    assert error_of("models = []\n").startswith("models.toml line 1 (models): is not a setting here")
    assert error_of('[[upstream]]\nurl = "http://h:1"\n[[upstream]]\nurl = "http://h:1/v1"\n') == \
        "The upstream http://h:1 (models.toml line 4 (upstream 2, url)) is given twice."
    syntax = error_of('[[model]]\npath = "/m/a.gguf\n')
    assert syntax.startswith("models.toml is not valid TOML:") and "line 2" in syntax


def test_an_unreadable_models_file_is_one_clear_sentence(tmp_path):
    with pytest.raises(SettingsError, match=r"^The models file nowhere.toml cannot be read "
                       r"\(No such file or directory\)\.$"):
        read_models_file(tmp_path / "nowhere.toml")


# --- keys kept private -------------------------------------------------------------------------

def test_a_models_file_holding_a_key_is_made_private_when_read(tmp_path):
    path = write(tmp_path, '[[upstream]]\nurl = "http://h:1"\napi_key = "sk-inline"\n')
    path.chmod(0o644)
    config = read_models_file(path)
    assert config.upstreams[0].api_key == "sk-inline"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_models_file_naming_a_key_file_stays_as_it_was_and_never_copies_the_key(tmp_path):
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "box2.key").write_text("box2-secret\n")
    path = write(tmp_path, '[[upstream]]\nurl = "http://h:1"\napi_key_file = "keys/box2.key"\n')
    path.chmod(0o644)
    config = read_models_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    write_models_file(config, path)
    assert "box2-secret" not in path.read_text()
    assert 'api_key_file = "keys/box2.key"' in path.read_text()
    assert read_models_file(path).upstreams[0].api_key == "box2-secret"


def test_a_written_file_with_a_key_is_private_and_without_one_is_not(tmp_path, loose_umask):
    keyed = PoolConfig(upstreams=(UpstreamEntry("http://h:1", "sk-inline"),))
    write_models_file(keyed, tmp_path / "keyed.toml")
    assert stat.S_IMODE((tmp_path / "keyed.toml").stat().st_mode) == 0o600
    write_models_file(PoolConfig(upstreams=(UpstreamEntry("http://h:1"),)), tmp_path / "plain.toml")
    assert not (tmp_path / "plain.toml").stat().st_mode & 0o022


# --- embeddings ------------------------------------------------------------------------------


def test_an_isolated_model_is_read_written_back_and_loaded_without_a_shared_prompt_cache():
    config = parse_models_file('[[model]]\npath = "/m/a.gguf"\nisolated = true\n'
                               'extra_args = ["--cache-ram", "4096"]\n')
    entry = config.models[0]
    assert entry.isolated
    assert parse_models_file(models_file_text(config)).models[0] == entry
    # Its own flags come last: they win over the same flags given as extra arguments.
    assert entry.to_spec().settings.extra_args == ("--cache-ram", "4096", "--no-cache-prompt",
                                                   "--cache-ram", "0")
    assert not ModelEntry.for_file("/m/b.gguf").isolated


def test_a_models_own_placement_is_read_and_written_back():
    config = parse_models_file('[[model]]\npath = "/m/a.gguf"\nplacement = "hash-ring"\n'
                               '[[model]]\npath = "/m/b.gguf"\n')
    ring, default = config.models
    assert (ring.placement, default.placement) == ("hash-ring", "")  # "": the port's setting
    assert parse_models_file(models_file_text(config)).models == (ring, default)


async def test_an_embeddings_entry_loads_into_an_engine_that_answers_embeddings(
        llama_server_binary, tmp_path, embedding_model):
    entry = parse_models_file(f'[[model]]\npath = {toml_string(str(embedding_model))}\n'
                              'embeddings = true\nparallel = 2\n').models[0]
    supervisor = Supervisor(llama_server_binary, tmp_path, load_timeout=120, stop_timeout=5)
    try:
        snapshot = await supervisor.load(entry.to_spec(own_template=False))
        serving = snapshot.serving
        assert serving is not None and snapshot.model_id == "tiny-embed"
        async with httpx.AsyncClient(headers=engine_headers(serving.api_key), timeout=60) as client:
            answer = await client.post(f"{serving.base_url}/v1/embeddings", json={"input": "a query"})
    finally:
        await supervisor.unload()
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"][0]["embedding"]) == EMBEDDING_LENGTH


# --- written back --------------------------------------------------------------------------------

def test_a_models_chat_template_is_its_own_none_a_built_in_or_a_file_and_is_written_back(tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "base.jinja").write_text("{{ messages[0]['content'] }}")
    path = write(tmp_path, '[[model]]\npath = "own.gguf"\nchat_template = true\n'
                           '[[model]]\npath = "off.gguf"\nchat_template = false\n'
                           '[[model]]\npath = "gemma.gguf"\nchat_template = "Gemma"\n'
                           '[[model]]\npath = "base.gguf"\nchat_template = "templates/base.jinja"\n')
    config = read_models_file(path)
    assert [m.settings.chat_template for m in config.models] == [
        "", "none", "gemma", str(tmp_path / "templates" / "base.jinja")]
    write_models_file(config, path)
    text = path.read_text()
    assert 'chat_template = false' in text and 'chat_template = "gemma"' in text
    assert 'chat_template = "templates/base.jinja"' in text  # relative to the file, as written
    assert read_models_file(path) == config


def test_a_file_written_back_reads_the_same_with_paths_relative_to_its_folder(tmp_path):
    (tmp_path / "box2.key").write_text("box2-secret\n")
    config = read_models_file(write(tmp_path, FULL))
    write_models_file(config, tmp_path / "again.toml")
    text = (tmp_path / "again.toml").read_text()
    assert 'path = "models/Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf"' in text
    assert 'idle_ttl = "30m"' in text and "--embeddings" not in text
    assert read_models_file(tmp_path / "again.toml") == config
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "models.toml").write_text(models_file_text(config))  # absolute paths: the same models
    assert read_models_file(moved / "models.toml") == config


def test_a_models_rpc_workers_are_read_from_the_file_and_written_back(tmp_path):
    config = parse_models_file('[[model]]\npath = "/m/big.gguf"\nrpc = "10.0.0.2, box3:6000"\n')
    assert config.models[0].settings.rpc == ("10.0.0.2:50052", "box3:6000")
    assert 'rpc = ["10.0.0.2:50052", "box3:6000"]' in models_file_text(config)
    assert parse_models_file(models_file_text(config)) == config


def test_a_default_configuration_writes_a_file_that_reads_back_empty():
    assert parse_models_file(models_file_text(PoolConfig())) == PoolConfig()


_names = st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn", "Zs")),
                 min_size=1, max_size=20).filter(str.isprintable)


@hypothesis_settings(max_examples=60, deadline=None)
@given(names=st.lists(_names, min_size=1, max_size=3, unique_by=str.casefold),
       ttl=st.integers(0, 10**6), ctx=st.integers(0, 10**6), key=st.text(
           st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=30))
def test_any_configuration_round_trips_through_its_file(names, ttl, ctx, key):
    # The path is the file's, normalised as read ("/m/0//.gguf" would read as "/m/0/.gguf").
    models = tuple(ModelEntry.for_file(f"/m/{i}/model.gguf", name, settings=LoadSettings(ctx_size=ctx),
                                       idle_ttl=float(ttl), aliases=(f"{name}-{i}-alias",))
                   for i, name in enumerate(names))
    config = PoolConfig(models, (UpstreamEntry("http://h:1", key, KvLayout.UNIFIED),), names[-1], 512)
    assert parse_models_file(models_file_text(config)) == config


@given(st.text())
def test_any_text_is_written_as_a_toml_string_that_reads_back_the_same(text):
    assert tomllib.loads(f"x = {toml_string(text)}")["x"] == text


def test_durations_read_as_people_write_them():
    assert [parse_duration(v) for v in (90, 1.5, "90s", "30m", "2h", "1d", "never", "0")] == \
        [90, 1.5, 90, 1800, 7200, 86400, 0, 0]
    for bad in ("-1", "soon", True, float("inf"), -3):
        with pytest.raises(ValueError):
            parse_duration(bad)


# --- paths ---------------------------------------------------------------------------------------

def test_relative_paths_are_the_models_files_folder_and_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = parse_models_file('[[model]]\npath = "~/m/a.gguf"\n[[model]]\npath = "../b.gguf"\n',
                               folder=tmp_path / "conf")
    assert [m.path for m in config.models] == [str(tmp_path / "home" / "m" / "a.gguf"),
                                               str(tmp_path / "b.gguf")]
    assert os.path.isabs(config.models[0].path)
