"""Newer Vulkan headers for the build: where they come from and when they are reused."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest

from backend.errors import EngineBuildFailed
from backend.llama import vulkan_headers
from backend.llama.accelerators import vulkan_headers_usable
from backend.llama.vulkan_headers import KEYRING, debian_archive_uri, ensure_vulkan_headers


def test_the_archive_is_the_one_the_system_already_installs_from(tmp_path: Path):
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm\n")
    assert debian_archive_uri(str(etc)) == "http://mirror.example/debian"

    legacy = tmp_path / "legacy"
    (legacy / "sources.list.d").mkdir(parents=True)
    (legacy / "sources.list").write_text(
        "deb [arch=amd64] http://other.example/debian bookworm main\n")
    assert debian_archive_uri(str(legacy)) == "http://other.example/debian"
    assert debian_archive_uri(str(tmp_path / "none")) is None


async def test_headers_fetched_once_are_reused_from_the_cache(tmp_path: Path):
    include = tmp_path / "toolkits" / "libvulkan-dev-1.4.309.0-1" / "usr" / "include"
    (include / "vulkan").mkdir(parents=True)
    (include / "vulkan" / "vulkan_structs.hpp").write_text("struct LayerSettingEXT {};")
    (include / "vulkan" / "vulkan_core.h").write_text(
        "#define VK_HEADER_VERSION 309\n#define VK_HEADER_VERSION_COMPLETE "
        "VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)\n")
    if vulkan_headers_usable("/usr/include"):
        pytest.skip("this machine's own Vulkan headers are new enough; nothing is fetched")
    headers = await ensure_vulkan_headers(tmp_path)
    assert headers.fetched
    assert headers.include_dir == include
    assert (headers.version, headers.package) == ("1.4.309", "libvulkan-dev=1.4.309.0-1")


@pytest.mark.timeout(60)
async def test_a_hung_apt_ends_with_a_readable_error_after_its_timeout(tmp_path: Path, monkeypatch):
    """A stand-in apt-get that never answers (and leaves a child holding its output, as
    apt's download methods do): the fetch gives up after its timeout, says so, and leaves
    neither process behind."""
    if vulkan_headers_usable("/usr/include"):
        pytest.skip("this machine's own Vulkan headers are new enough; apt is not asked")
    if not (debian_archive_uri() and shutil.which("dpkg-deb") and os.path.exists(KEYRING)):
        pytest.skip("not a Debian system: the headers are not fetched with apt here")
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    pids = tmp_path / "apt.pids"
    (stand_ins / "apt-get").write_text(f"#!/bin/sh\necho $$ >> {pids}\nsleep 300 &\n"
                                       f"echo $! >> {pids}\nwait\n")
    (stand_ins / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{stand_ins}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(vulkan_headers, "APT_TIMEOUT", 1.0)
    try:
        with pytest.raises(EngineBuildFailed) as refused:
            await ensure_vulkan_headers(tmp_path / "cache")
        assert "Reading the Debian package index failed" in str(refused.value)
        assert "no answer from apt-get in 1 s" in str(refused.value)
        assert [p.name for p in (tmp_path / "cache" / "toolkits").iterdir()] == []
        assert not any(_alive(int(pid)) for pid in pids.read_text().split())
    finally:
        for pid in pids.read_text().split() if pids.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
