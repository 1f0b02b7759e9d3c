"""Vulkan headers new enough for the pinned llama.cpp, from the distribution's archive.

Debian 12 ships Vulkan headers 1.3.239; the pinned llama.cpp uses vk::LayerSettingEXT,
which those lack (its compile stops there).  The headers are header-only, so instead of upgrading the system we ask apt
(the ordinary client, with a private configuration that leaves the system's untouched)
to download Debian 13's `libvulkan-dev` from the same archive the system already uses,
check it came signed through apt, and unpack only its include/ tree into the cache.  The
build then points CMake at it with -DVulkan_INCLUDE_DIR; the loader library stays the
system's (Vulkan's ABI is stable; new entry points are looked up at run time).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from backend.llama.accelerators import vulkan_header_version, vulkan_headers_usable
from backend.llama.environment import engine_environment
from backend.errors import EngineBuildFailed

# The Debian release whose libvulkan-dev (1.4.309) carries what the pinned llama.cpp uses.
NEWER_SUITE = "trixie"
PACKAGE = "libvulkan-dev"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# Seconds one apt-get call may take (a release's package index is tens of MB), and the
# unpacking of the one package.  Past them the call is stopped and the build says so.
APT_TIMEOUT = 600.0
UNPACK_TIMEOUT = 120.0


@dataclass(frozen=True)
class VulkanHeaders:
    include_dir: Path
    version: str
    fetched: bool  # True: unpacked from the archive into the cache; False: the system's
    package: str = ""  # "libvulkan-dev=<Debian version>" when fetched


async def ensure_vulkan_headers(cache_dir: Path,
                                report: Callable[[str], None] = lambda line: None) -> VulkanHeaders:
    """The system's headers when they suffice, else newer ones fetched once into the cache."""
    system = "/usr/include"
    if vulkan_headers_usable(system):
        return VulkanHeaders(Path(system), vulkan_header_version(system) or "system", False)
    root = cache_dir / "toolkits"
    for existing in sorted(root.glob(f"{PACKAGE}-*/usr/include")):
        if vulkan_headers_usable(str(existing)):
            debian_version = existing.parent.parent.name[len(PACKAGE) + 1:]
            return VulkanHeaders(existing, vulkan_header_version(str(existing)) or "?", True,
                                 f"{PACKAGE}={debian_version}")
    report(f"system Vulkan headers are too old; fetching {PACKAGE} from Debian {NEWER_SUITE}")
    return await asyncio.to_thread(_fetch, root)


def debian_archive_uri(sources_dir: str = "/etc/apt") -> str | None:
    """The Debian archive this system already installs from (its main, non-security entry)."""
    files = glob.glob(os.path.join(sources_dir, "sources.list.d", "*.sources"))
    files += [os.path.join(sources_dir, "sources.list")]
    files += glob.glob(os.path.join(sources_dir, "sources.list.d", "*.list"))
    for path in files:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        uris: list[str] = re.findall(r"^URIs:\s*(\S+)", text, re.M) + re.findall(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", text, re.M)
        for uri in uris:
            if "security" not in uri and uri.rstrip("/").endswith("/debian"):
                return uri.rstrip("/")
    return None


# --- helpers ------------------------------------------------------------------------------


def _fetch(root: Path) -> VulkanHeaders:
    apt_get = shutil.which("apt-get")
    dpkg_deb = shutil.which("dpkg-deb")
    uri = debian_archive_uri()
    if not (apt_get and dpkg_deb and uri and os.path.exists(KEYRING)):
        raise EngineBuildFailed(
            "The system's Vulkan headers are too old for llama.cpp (vk::LayerSettingEXT is "
            "missing) and no Debian archive is configured to fetch newer ones; install "
            "Vulkan headers 1.3.275 or newer (the Vulkan SDK).")
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root, prefix=".apt-"))
    try:
        etc = work / "etc"
        for d in (etc / "sources.list.d", etc / "preferences.d", etc / "apt.conf.d",
                  work / "lists" / "partial", work / "cache" / "archives" / "partial"):
            d.mkdir(parents=True)
        (etc / "sources.list").write_text(
            f"deb [signed-by={KEYRING}] {uri} {NEWER_SUITE} main\n")
        options = [f"-o=Dir::Etc={etc}", f"-o=Dir::State::Lists={work / 'lists'}",
                   f"-o=Dir::Cache={work / 'cache'}", "-o=Dir::State::status=/dev/null",
                   "-o=Debug::NoLocking=1", "-o=APT::Sandbox::User=root", "-qq"]
        _check([apt_get, *options, "update"], work, "Reading the Debian package index failed",
               APT_TIMEOUT)
        _check([apt_get, *options, "download", PACKAGE], work,
               f"Downloading {PACKAGE} from Debian {NEWER_SUITE} failed", APT_TIMEOUT)
        deb = next(work.glob(f"{PACKAGE}_*.deb"), None)
        if deb is None:
            raise EngineBuildFailed(f"apt did not download {PACKAGE}.")
        version = deb.name.split("_")[1]
        unpacked = work / "unpacked"
        _check([dpkg_deb, "-x", str(deb), str(unpacked)], work, f"Unpacking {PACKAGE} failed",
               UNPACK_TIMEOUT)
        final = root / f"{PACKAGE}-{version}"
        if final.exists():
            shutil.rmtree(final)
        # Only the headers: the loader library stays the system's.
        (final / "usr").mkdir(parents=True)
        os.replace(unpacked / "usr" / "include", final / "usr" / "include")
        include = final / "usr" / "include"
        if not vulkan_headers_usable(str(include)):
            raise EngineBuildFailed(f"{PACKAGE} {version} from Debian {NEWER_SUITE} is still too old.")
        return VulkanHeaders(include, vulkan_header_version(str(include)) or version, True,
                             f"{PACKAGE}={version}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check(cmd: list[str], cwd: Path, failure: str, timeout: float) -> None:
    """Run `cmd`; a failure or a run past `timeout` seconds raises EngineBuildFailed.  The
    command runs in a process group of its own, so a stop ends the helpers it started
    too (apt's download methods), which would otherwise hold its output open."""
    with subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env=engine_environment()) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise EngineBuildFailed(f"{failure}: no answer from {Path(cmd[0]).name} in "
                                        f"{timeout:g} s; it was stopped.") from None
            raise
    if proc.returncode != 0:
        raise EngineBuildFailed(f"{failure} (exit {proc.returncode}).", (err or out)[-2000:])
