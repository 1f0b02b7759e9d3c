"""Newer Vulkan headers for the build: where they come from and when they are reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.llama.accelerators import vulkan_headers_usable
from backend.llama.vulkan_headers import debian_archive_uri, ensure_vulkan_headers


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
