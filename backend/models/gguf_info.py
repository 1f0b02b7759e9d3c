"""What a GGUF file says about itself, read without loading the model.

Only the header is parsed: metadata and tensor descriptions.  Weights are never
read; the file's size is checked against where the tensors say their data ends,
which is how a truncated download is caught.

The `gguf` package supplies the format's constants.  Its `GGUFReader` is not used
because it decodes every element of every metadata array in Python: 1.4 s for a
32k vocabulary, 10 s for Qwen2's and 17 s for Llama 3's, where this reader skips
those arrays in a fraction of a second.  Short arrays of numbers are read: they are the
per-layer numbers (KV heads, the sliding-window pattern, the recurrent layers) that say
what each layer keeps in memory (`backend.models.memory_layout`).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import stat
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    LlamaFileType,
)

from backend.errors import ModelFileError
from backend.models.memory_layout import MemoryLayout, memory_layout


@dataclass(frozen=True)
class ModelInfo:
    path: str
    file_size: int
    name: str
    architecture: str
    parameter_count: int
    file_type: str
    context_length: int | None
    layer_count: int | None
    embedding_length: int | None
    has_chat_template: bool
    chat_template: str | None
    # What the KV cache's size depends on (see backend.models.fit); None when not stated.
    head_count: int | None = None
    head_count_kv: int | None = None
    key_length: int | None = None
    value_length: int | None = None
    #: What each layer keeps beside the weights: the KV cache's layers, the sliding
    #: window, the recurrent state (see backend.models.fit); None when not stated.
    memory: MemoryLayout | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["memory"] = self.memory.to_dict() if self.memory is not None else None
        return data

    def summary_lines(self) -> list[str]:
        def known(value: int | None) -> str:
            return "unknown" if value is None else str(value)

        return [
            f"Name: {self.name}",
            f"File: {Path(self.path).name} ({format_file_size(self.file_size)})",
            f"Architecture: {self.architecture}",
            f"Parameters: {format_parameter_count(self.parameter_count)}",
            f"Quantization: {self.file_type}",
            f"Context length: {known(self.context_length)}",
            f"Layers: {known(self.layer_count)}",
            f"Embedding length: {known(self.embedding_length)}",
            "Chat template: " + ("yes" if self.has_chat_template else
                                 "no (chat requests are refused; plain prompts work; pick one "
                                 "with serve --chat-template NAME|FILE)"),
            *([f"Memory: {self.memory.describe()}"] if self.memory is not None else []),
        ]


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    """Read a model's metadata; any unusable file raises a one-line `ModelFileError`."""
    path = Path(path)
    header = _read_header(path)
    metadata = header.metadata
    architecture = _text(metadata.get("general.architecture")) or "unknown"

    def arch_int(key: str) -> int | None:
        return _integer(metadata.get(f"{architecture}.{key}"))

    template = _text(metadata.get("tokenizer.chat_template"))
    return ModelInfo(
        path=os.path.abspath(path),
        file_size=header.file_size,
        name=_text(metadata.get("general.name")) or path.stem,
        architecture=architecture,
        parameter_count=sum(t.n_elements for t in header.tensors),
        file_type=_file_type(metadata, header.tensors),
        context_length=arch_int("context_length"),
        layer_count=arch_int("block_count"),
        embedding_length=arch_int("embedding_length"),
        has_chat_template=template is not None,
        chat_template=template,
        head_count=_first_integer(metadata.get(f"{architecture}.attention.head_count")),
        head_count_kv=_first_integer(metadata.get(f"{architecture}.attention.head_count_kv")),
        key_length=arch_int("attention.key_length"),
        value_length=arch_int("attention.value_length"),
        memory=memory_layout(architecture, metadata),
    )


def format_parameter_count(n: int) -> str:
    """Three significant digits with a unit: 950, 17.2 K, 17.2 M, 7.24 B."""
    if n < 1000:
        return str(n)
    # Ascending, so that 999,999 becomes "1.00 M" rather than "1000 K".
    for scale, unit in ((1e3, "K"), (1e6, "M"), (1e9, "B"), (1e12, "T")):
        text = _three_digits(n / scale)
        if float(text) < 1000 or unit == "T":
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def format_file_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# --- parsing ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    type: int
    n_elements: int
    n_bytes: int | None  # None for a tensor type this `gguf` version does not know
    offset: int


@dataclass(frozen=True)
class _Header:
    file_size: int
    metadata: dict[str, Any]
    tensors: list[_Tensor]


class _Corrupt(Exception):
    pass


# Arrays are skipped, not decoded: they are the vocabulary and merges, never needed here;
# but an array of at most this many numbers is read, as a tuple: a per-layer setting.
_SKIPPED = object()
_MAX_READ_ARRAY = 4096

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SUPPORTED_VERSIONS = (2, 3)
# llama.cpp's own limits (GGML_MAX_DIMS, INT64_MAX elements): a file beyond them is
# corrupt or hostile, and an unbounded product of dimensions costs quadratic time.
_MAX_DIMS = 4
_MAX_ELEMENTS = 2**63 - 1
# Arrays of arrays are legal but never deep; deeper nesting is a crafted file.
_MAX_ARRAY_NESTING = 8
_GUESSED_FILE_TYPE = 1024  # llama.cpp's LLAMA_FTYPE_GUESSED flag


def _read_header(path: Path) -> _Header:
    label = path.name or str(path)

    def fail(reason: str) -> ModelFileError:
        return ModelFileError(f"{label}: {reason}")

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise fail("no such file") from None
    except OSError as error:
        raise fail(_os_reason(error)) from None
    if stat.S_ISDIR(st.st_mode):
        raise fail("is a folder, not a model file")
    # Opening a pipe or device could block forever or never end.
    if not stat.S_ISREG(st.st_mode):
        raise fail("is not a regular file")
    if st.st_size == 0:
        raise fail("file is empty")

    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(data, len(data), fail)
    except ModelFileError:
        raise
    except (_Corrupt, struct.error, IndexError, OverflowError):
        raise fail("file is truncated or corrupt (its header cannot be read)") from None
    except MemoryError:
        raise fail("file is corrupt (its header claims an impossible size)") from None
    except ValueError as error:
        # mmap refuses some files (e.g. one that shrank after stat) with ValueError.
        raise fail(f"file cannot be read ({error})") from None
    except OSError as error:
        raise fail(_os_reason(error)) from None


def _parse(data: mmap.mmap, file_size: int, fail: Callable[[str], ModelFileError]) -> _Header:
    if file_size < 8 or struct.unpack_from("<I", data, 0)[0] != GGUF_MAGIC:
        raise fail("not a GGUF model file")
    order = "<"
    version = struct.unpack_from("<I", data, 4)[0]
    # A version whose low half is zero was written on a machine of the other byte order.
    if version & 0xFFFF == 0:
        order = ">"
        version = struct.unpack_from(">I", data, 4)[0]
    if version not in _SUPPORTED_VERSIONS:
        raise fail(f"GGUF version {version} is not supported")

    reader = _Cursor(data, order, offset=8)
    tensor_count = reader.scalar("Q")
    kv_count = reader.scalar("Q")

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("I"))

    tensors = []
    for _ in range(tensor_count):
        name = reader.string()
        n_dims = reader.scalar("I")
        if n_dims > _MAX_DIMS:
            raise fail(f"file is corrupt (a tensor has {n_dims:,} dimensions, at most "
                       f"{_MAX_DIMS} are possible)")
        n_elements = 1
        for _ in range(n_dims):
            n_elements *= reader.scalar("Q")
        if n_elements > _MAX_ELEMENTS:
            raise fail("file is corrupt (a tensor claims an impossible number of elements)")
        tensor_type = reader.scalar("I")
        offset = reader.scalar("Q")
        tensors.append(_Tensor(name, tensor_type, n_elements, _tensor_bytes(tensor_type, n_elements),
                               offset))

    alignment = _integer(metadata.get("general.alignment")) or GGUF_DEFAULT_ALIGNMENT
    if alignment & (alignment - 1):
        raise fail(f"file is corrupt (alignment {alignment} is not a power of two)")
    data_start = -(-reader.offset // alignment) * alignment
    data_end = max((data_start + t.offset + t.n_bytes for t in tensors if t.n_bytes is not None),
                   default=reader.offset)
    if data_end > file_size:
        raise fail(f"file is truncated ({file_size:,} of {data_end:,} bytes present)")
    return _Header(file_size, metadata, tensors)


class _Cursor:
    def __init__(self, data: mmap.mmap, order: str, offset: int) -> None:
        self.data = data
        self.order = order
        self.offset = offset

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(self.order + fmt, self.data, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.offset + length
        if end > len(self.data):
            raise _Corrupt
        text = self.data[self.offset:end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            start = self.offset
            item_type = self.scalar("I")
            count = self.scalar("Q")
            fmt = _SCALARS.get(item_type)
            if fmt is not None and count <= _MAX_READ_ARRAY:
                items = struct.unpack_from(f"{self.order}{count}{fmt}", self.data, self.offset)
                self.offset += count * struct.calcsize(fmt)
                return items
            self.offset = start
            self.skip_array()
            return _SKIPPED
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise _Corrupt
        return self.scalar(fmt)

    def skip_array(self) -> None:
        """Step over an array, arrays of arrays included, without recursion (a crafted
        file may nest them thousands deep)."""
        unpack, data = struct.Struct(self.order + "Q").unpack_from, self.data
        pending = [1]  # arrays still to skip, per nesting level
        while pending:
            if pending[-1] == 0:
                pending.pop()
                continue
            pending[-1] -= 1
            item_type = self.scalar("I")
            count = self.scalar("Q")
            fmt = _SCALARS.get(item_type)
            if fmt is not None:
                self.offset += count * struct.calcsize(fmt)
            elif item_type == GGUFValueType.STRING:
                offset = self.offset
                for _ in range(count):
                    offset += 8 + unpack(data, offset)[0]
                self.offset = offset
            elif item_type == GGUFValueType.ARRAY:
                if len(pending) >= _MAX_ARRAY_NESTING:
                    raise _Corrupt
                pending.append(count)
            else:
                raise _Corrupt
            if self.offset > len(data):
                raise _Corrupt


def _tensor_bytes(tensor_type: int, n_elements: int) -> int | None:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor_type)]
    except (ValueError, KeyError):
        return None
    return n_elements * type_size // block_size


def _file_type(metadata: dict[str, Any], tensors: list[_Tensor]) -> str:
    declared = _integer(metadata.get("general.file_type"))
    if declared is not None:
        try:
            name = LlamaFileType(declared & ~_GUESSED_FILE_TYPE).name
        except ValueError:
            pass
        else:
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return _dominant_tensor_type(tensors)


def _dominant_tensor_type(tensors: list[_Tensor]) -> str:
    elements: Counter[int] = Counter()
    for tensor in tensors:
        elements[tensor.type] += tensor.n_elements
    if not elements:
        return "unknown"
    dominant = elements.most_common(1)[0][0]
    try:
        return GGMLQuantizationType(dominant).name
    except ValueError:
        return f"type {dominant}"


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _integer(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _first_integer(value: Any) -> int | None:
    # Some architectures give a per-layer list of head counts; the largest bounds the cache.
    if isinstance(value, (list, tuple)):
        numbers = [v for v in (_integer(x) for x in value) if v is not None]
        return max(numbers) if numbers else None
    return _integer(value)


def _three_digits(value: float) -> str:
    for decimals, limit in ((2, 9.995), (1, 99.95)):
        if value < limit:
            return f"{value:.{decimals}f}"
    return f"{value:.0f}"


def _os_reason(error: OSError) -> str:
    if isinstance(error, PermissionError):
        return "permission denied"
    return f"cannot be read ({error.strerror or type(error).__name__})"
