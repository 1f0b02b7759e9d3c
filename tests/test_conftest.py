"""The suite's own switches (tests/conftest.py): GGUF_STUDIO_TESTS_REQUIRE turns the skips
of a part that must run on this machine into failures, and names what it may name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_ENV, USER_ENGINE, USER_ENVIRON

ROOT = Path(__file__).resolve().parents[1]
VULKAN_TESTS = "tests/backend/llama/test_vulkan_engine.py"


def run_pytest(*args: str, require: str | None) -> subprocess.CompletedProcess[str]:
    # As the user started the suite: that run finds the user's engine and keeps out of
    # the user's dirs itself (and checks so).
    env = {name: value for name, value in USER_ENVIRON.items() if name != REQUIRE_ENV}
    if require is not None:
        env[REQUIRE_ENV] = require
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_a_required_part_that_skips_fails_the_run_saying_why() -> None:
    if USER_ENGINE.managed_binary_for("vulkan") is not None:
        pytest.skip("a Vulkan engine is built here: its tests run rather than skip")
    skipped = run_pytest(VULKAN_TESTS, require=None)
    assert skipped.returncode == 0 and "skipped" in skipped.stdout, skipped.stdout[-2000:]
    required = run_pytest(VULKAN_TESTS, require="vulkan")
    assert required.returncode == 1, required.stdout[-2000:]
    assert f"{REQUIRE_ENV} says the vulkan tests must run on this machine" in required.stdout
    assert "no Vulkan engine built" in required.stdout  # the skip's own reason is kept


def test_an_unknown_part_is_a_usage_error() -> None:
    answer = run_pytest("tests/test_conftest.py", "--collect-only", require="gpu")
    assert answer.returncode == 4  # pytest's usage error
    assert "may name clients, vulkan" in answer.stderr
