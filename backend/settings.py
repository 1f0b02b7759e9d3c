"""Settings: one dataclass, layered as saved file < environment < command line.

Every limit the gateway enforces lives here with its default, so that the window,
the command line and the environment all configure the same thing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from backend.errors import SettingsError

APP_NAME = "gguf-studio"
ENV_PREFIX = "GGUF_STUDIO_"


@dataclass
class Settings:
    # The OpenAI-compatible port.
    host: str = "127.0.0.1"
    port: int = 8899
    api_key: str = ""
    allow_no_key: bool = False
    # Admission.  max_queue 0 means "16 x slots, at least 64"; see effective_max_queue.
    max_queue: int = 0
    queue_timeout: float = 600.0
    keepalive_interval: float = 5.0
    max_output_tokens: int = 0
    # Output tokens reserved for a request that sends no limit (backend.prompt_tokens).
    default_output_tokens: int = 2048
    max_body_bytes: int = 32 * 1024 * 1024
    reload_grace: float = 30.0
    admission_enabled: bool = True
    # The engine.
    llama_server: str = ""
    load_timeout: float = 300.0
    max_restarts: int = 5
    stop_timeout: float = 10.0
    # Last load, so that `serve` and the window can offer it again.
    model: str = ""
    upstream: str = ""
    parallel: str = "auto"
    ctx_size: int = 0
    n_gpu_layers: int = 0
    threads: int = 0
    extra_args: list[str] = field(default_factory=list)

    def effective_max_queue(self, slots: int) -> int:
        """Waiting places for a load with `slots` slots; 0 from the user means default."""
        if self.max_queue > 0:
            return self.max_queue
        return max(64, 16 * max(slots, 1))

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    # --- persistence ---------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | None = None, environ: Mapping[str, str] | None = None) -> "Settings":
        """Saved settings, then overridden by GGUF_STUDIO_* environment variables."""
        path = path or settings_path()
        saved = _read_saved(path) if path.is_file() else {}
        return cls().with_overrides(saved).with_overrides(env_overrides(environ if environ is not None else os.environ))

    def save(self, path: Path | None = None, environ: Mapping[str, str] | None = None) -> None:
        """Write the settings, except values that came from the environment: those stay
        as they were saved, so an exported GGUF_STUDIO_* is never made permanent."""
        path = path or settings_path()
        values = dataclasses.asdict(self)
        from_env = Settings().with_overrides(env_overrides(os.environ if environ is None else environ))
        previous = _read_saved(path) if path.is_file() else {}
        for name in env_overrides(os.environ if environ is None else environ):
            if values[name] == getattr(from_env, name):
                values[name] = previous.get(name, getattr(Settings(), name))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(values, indent=2))
        os.replace(tmp, path)

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Settings":
        """A copy with `overrides` (field name -> raw value) converted and applied."""
        types = {f.name: f.type for f in fields(self)}
        converted = {}
        for name, raw in overrides.items():
            if raw is None:
                continue
            if name not in types:
                raise SettingsError(f"Unknown setting {name!r}.")
            converted[name] = _convert(name, types[name], raw)
        return dataclasses.replace(self, **converted)


def settings_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "settings.json"


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """GGUF_STUDIO_MAX_QUEUE=8 -> {"max_queue": "8"}, for every known setting."""
    out = {}
    for f in fields(Settings):
        key = ENV_PREFIX + f.name.upper()
        if key in environ:
            out[f.name] = environ[key]
    return out


def _read_saved(path: Path) -> dict[str, Any]:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"The settings file {path.name} is not readable JSON: {exc}") from None
    if not isinstance(saved, dict):
        raise SettingsError(f"The settings file {path.name} does not hold settings.")
    known = {f.name for f in fields(Settings)}
    return {k: v for k, v in saved.items() if k in known}


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _convert(name: str, type_name: str, raw: Any) -> Any:
    try:
        if type_name == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in {"1", "true", "yes", "on"}:
                return True
            if text in {"0", "false", "no", "off", ""}:
                return False
            raise ValueError(raw)
        if type_name == "int":
            value = int(raw)
        elif type_name == "float":
            value = float(raw)
        elif type_name.startswith("list"):
            return [str(v) for v in raw] if isinstance(raw, (list, tuple)) else str(raw).split()
        else:
            return str(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"Setting {name} has an unusable value {raw!r}.") from None
    if value < 0:
        raise SettingsError(f"Setting {name} must not be negative (got {raw!r}).")
    return value
