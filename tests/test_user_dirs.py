"""The suite keeps out of the user's own dirs: every place the product writes points into
the session's private folder (also for fixtures wider than one test), and the check that
fails the session names what appeared or changed."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs
import pytest

from backend.app.service import StudioService
from backend.keys.usage import usage_path
from backend.keys.key_store import keys_path
from backend.llama.engine import ENV_LLAMA_SERVER, Engine
from backend.models.hf_cache import hugging_face_cache
from backend.settings import APP_NAME, Settings, settings_path
from tests.conftest import SESSION_HOME, USER_DIRS
from tests.user_dirs import Listing, UserDirs


@pytest.fixture(scope="module")
def module_wide_places() -> list[Path]:
    """Where a module-scoped fixture (which starts before the per-test config dir) writes."""
    return [usage_path(), keys_path(), settings_path(), Path(platformdirs.user_log_dir(APP_NAME))]


def test_module_wide_fixtures_write_into_the_session_not_the_user(module_wide_places: list[Path]) -> None:
    for place in module_wide_places:
        assert place.is_relative_to(SESSION_HOME), place
        assert not _under_user_dirs(place), place


def test_every_place_the_product_writes_is_private(tmp_path_factory: pytest.TempPathFactory) -> None:
    service = StudioService(Settings())
    places = [usage_path(), keys_path(), settings_path(), service.log_dir, Engine().data_dir,
              hugging_face_cache(), Path(os.environ["LLAMA_CACHE"]), Path.home(),
              Path(platformdirs.user_cache_dir(APP_NAME)), Path(platformdirs.user_state_dir(APP_NAME))]
    for place in places:
        assert not _under_user_dirs(place), place
        assert place.is_relative_to(SESSION_HOME) or place.is_relative_to(tmp_path_factory.getbasetemp()), place


def test_the_users_engine_is_still_found(llama_server_binary: Path) -> None:
    """The engine built into the user's data dir runs the suite's services."""
    assert Engine().resolve().path == llama_server_binary == Path(os.environ[ENV_LLAMA_SERVER])


def test_the_check_names_what_appeared_changed_and_went(tmp_path: Path) -> None:
    own, shared = tmp_path / "own", tmp_path / "shared"
    (own / "logs").mkdir(parents=True)
    shared.mkdir()
    (own / "usage.json").write_text("{}")
    (own / "old.log").write_text("x")
    (shared / "deep").mkdir()
    dirs = UserDirs(whole=(own,), top=(shared,))
    before = dirs.listing()
    assert dirs.listing().changes_since(before) == []

    (own / "usage.json").write_text('{"refused": 1072}')
    (own / "logs" / "engine.log").write_text("started")
    (own / "old.log").unlink()
    (shared / "deep" / "other-program.txt").write_text("not ours to watch")
    (shared / "gguf-studio.desktop").write_text("[Desktop Entry]")
    changes = dirs.listing().changes_since(before)
    assert f"changed: {own / 'usage.json'}" in changes
    assert f"appeared: {own / 'logs' / 'engine.log'}" in changes
    assert f"went: {own / 'old.log'}" in changes
    assert f"appeared: {shared / 'gguf-studio.desktop'}" in changes
    assert not any("other-program" in line for line in changes)


def test_the_clients_the_suite_installs_for_itself_are_not_counted(tmp_path: Path) -> None:
    own = tmp_path / "cache" / "gguf-studio"
    own.mkdir(parents=True)
    dirs = UserDirs(whole=(own,), top=(), own_tools=(own / "clients",))
    before = dirs.listing()
    (own / "clients" / "node_modules").mkdir(parents=True)
    (own / "clients" / "clients.env").write_text("CODEX_BIN=...")
    assert dirs.listing().changes_since(before) == []
    (own / "usage.json").write_text("{}")
    assert dirs.listing().changes_since(before) == [f"appeared: {own / 'usage.json'}"]


def test_an_empty_listing_has_no_changes() -> None:
    assert Listing({}).changes_since(Listing({})) == []


def _under_user_dirs(place: Path) -> bool:
    return any(place.resolve().is_relative_to(d.resolve()) for d in USER_DIRS.whole)


def test_each_test_parks_prefixes_in_a_data_dir_of_its_own(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A prefix parked by one test is never restored into the next test's turn of the
    same prompt (it was: the session's data dir was shared)."""
    parked = StudioService(Settings()).parking.lot.directory
    assert parked.is_relative_to(tmp_path_factory.getbasetemp())
    assert not parked.is_relative_to(SESSION_HOME)
