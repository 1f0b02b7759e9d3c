"""Writing a teammate's Codex CLI, OpenCode and Claude Code configuration for a port
(`connect`).

What the window's snippets say (`backend.app.sharing.snippets`), written where the clients read
it, next to what the user has:

- **The key** goes into a file of its own, 0600 in a 0700 directory
  (`$XDG_CONFIG_HOME/gguf-studio/connections/PROFILE.key`), never into a config file;
  the profile is the port's name unless the user names one, and a key file it replaces is
  kept as a private backup first (a key may be the only copy of another port's).
  Codex reads it with its provider `auth.command` (`cat FILE`), OpenCode with its
  `{file:FILE}` substitution, Claude Code with its `apiKeyHelper` (`cat FILE`): none
  needs it in the environment.
- **Codex CLI**: a profile file `$CODEX_HOME/PROFILE.config.toml` (Codex 0.171 layers it
  over config.toml with `codex --profile PROFILE`) holding the model and its own
  `[model_providers.PROFILE]`, so config.toml and other profiles stay as they are; one
  more profile per other model (`PROFILE-MODEL`).
- **OpenCode**: the provider `PROFILE` added to `opencode.json` beside the user's
  others; its `model` is set only where the file names none
  (`opencode -m PROFILE/MODEL` picks ours otherwise).  `small_model` is left as it is:
  it serves every provider's titles, so pointing it at one port would send the titles of
  the user's other conversations there.
- **Claude Code**: a settings file of its own, `~/.claude/settings.gguf-studio-PROFILE.json`
  (`$CLAUDE_CONFIG_DIR` when set), used with `claude --settings FILE`, which layers it
  over the user's settings.json (left as it is): the port and its models in its `env`
  (`backend.app.sharing.snippets.claude_code_env`), the key by `apiKeyHelper`.

Every file that exists is copied to `NAME.bak-YYYYMMDD-HHMMSS` before it changes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from backend.app.sharing.snippets import (ClientModel, ClientTarget, claude_code_env,
                                          codex_model_lines, opencode_snippet)
from backend.toml_text import toml_string
from backend.errors import ConnectCommandFailed
from backend.private_files import write_private
from backend.settings import APP_NAME

__all__ = ["WrittenConfig", "profile_name", "write_client_config"]


@dataclass(frozen=True)
class WrittenConfig:
    """What `write_client_config` wrote, and how to use it."""

    key_file: Path
    files: tuple[Path, ...]
    backups: tuple[Path, ...]
    codex_command: str
    opencode_command: str
    notes: tuple[str, ...] = ()
    claude_command: str = ""


def profile_name(text: str) -> str:
    """A profile and provider id from a port's name: letters, digits, - and _."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-_").lower()
    return slug[:40] or "gguf-studio"


def write_client_config(target: ClientTarget, profile: str, port_name: str) -> WrittenConfig:
    """Write the key file, the Codex profiles and the OpenCode provider for `target`
    (its `api_key` the secret, its `base_url` the port's /v1)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    key_file = connections_dir() / f"{profile}.key"
    files: list[Path] = []
    backups: list[Path] = []
    _backup(key_file, stamp, backups, private=True)
    write_private(key_file, target.api_key.encode() + b"\n")
    notes: list[str] = []
    codex_home = Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
    codex_home.mkdir(parents=True, exist_ok=True)
    first, *others = target.models
    for name, model in [(profile, first)] + [(profile_name(f"{profile}-{m.model_id}"), m)
                                             for m in others]:
        path = codex_home / f"{name}.config.toml"
        _backup(path, stamp, backups)
        path.write_text(_codex_profile(target, model, profile, port_name, key_file))
        files.append(path)
    opencode = Path(platformdirs.user_config_dir("opencode", appauthor=False)) / "opencode.json"
    if opencode.with_suffix(".jsonc").exists() and not opencode.exists():
        notes.append(f"OpenCode: {opencode.with_suffix('.jsonc')} has comments this command "
                     "does not keep; left as it is (the window's Sharing tab shows the snippet).")
    else:
        try:
            _write_opencode(opencode, target, profile, port_name, key_file, stamp, backups)
            files.append(opencode)
        except ConnectCommandFailed as exc:
            notes.append(str(exc))
    claude = claude_dir() / f"settings.gguf-studio-{profile}.json"
    _backup(claude, stamp, backups)
    claude.parent.mkdir(parents=True, exist_ok=True)
    claude.write_text(json.dumps({"apiKeyHelper": f"cat {shlex.quote(str(key_file))}",
                                  "env": claude_code_env(target)}, indent=2) + "\n")
    files.append(claude)
    return WrittenConfig(key_file, tuple(files), tuple(backups),
                         f"codex --profile {profile}",
                         f"opencode -m {shlex.quote(f'{profile}/{first.model_id}')}",
                         tuple(notes), f"claude --settings {shlex.quote(str(claude))}")


def connections_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "connections"


def claude_dir() -> Path:
    """Claude Code's config dir: `$CLAUDE_CONFIG_DIR`, else ~/.claude."""
    return Path(os.environ.get("CLAUDE_CONFIG_DIR") or Path.home() / ".claude")


# --- helpers -------------------------------------------------------------------------------


def _codex_profile(target: ClientTarget, model: ClientModel, profile: str, port_name: str,
                   key_file: Path) -> str:
    lines = [line.replace('model_provider = "gguf-studio"',
                          f"model_provider = {toml_string(profile)}")
             for line in codex_model_lines(target, model)]
    lines += ["", f"[model_providers.{profile}]",
              f"name = {toml_string(f'GGUF Studio ({port_name})')}",
              f"base_url = {toml_string(target.base_url)}",
              'wire_api = "responses"',
              "",
              # The key stays in its 0600 file: Codex runs this for it.
              f"[model_providers.{profile}.auth]",
              'command = "cat"',
              f"args = [{toml_string(str(key_file))}]"]
    return "\n".join(lines) + "\n"


def _write_opencode(path: Path, target: ClientTarget, profile: str, port_name: str,
                    key_file: Path, stamp: str, backups: list[Path]) -> None:
    config: dict[str, object] = {}
    if path.exists():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            raise ConnectCommandFailed(
                f"OpenCode: {path} is not plain JSON; left as it is.") from None
        if not isinstance(loaded, dict):
            raise ConnectCommandFailed(f"OpenCode: {path} holds no settings; left as it is.")
        config = loaded
    ours = json.loads(opencode_snippet(target).text)
    (provider,) = ours["provider"].values()
    provider["name"] = f"GGUF Studio ({port_name})"
    provider["options"]["apiKey"] = "{file:" + str(key_file) + "}"
    providers = config.get("provider")
    if not isinstance(providers, dict):
        providers = config["provider"] = {}
    providers[profile] = provider
    config.setdefault("$schema", ours["$schema"])
    config.setdefault("model", ours["model"].replace("gguf-studio/", f"{profile}/", 1))
    _backup(path, stamp, backups)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")


def _backup(path: Path, stamp: str, backups: list[Path], *, private: bool = False) -> None:
    """Copy `path` aside before it changes; a `private` one (a key) is copied 0600 from
    its first byte, never readable by others for a moment as a plain copy would be."""
    if path.exists():
        copy = path.with_name(f"{path.name}.bak-{stamp}")
        n = 1
        while copy.exists():  # two connects within a second: keep the older backup too
            n += 1
            copy = path.with_name(f"{path.name}.bak-{stamp}-{n}")
        if private:
            write_private(copy, path.read_bytes())
        else:
            shutil.copy2(path, copy)
        backups.append(copy)
