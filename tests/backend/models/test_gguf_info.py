from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGUF_MAGIC

from backend.models import gguf_info
from backend.errors import ModelFileError
from backend.models.gguf_info import ModelInfo, format_parameter_count, read_model_info
from tests.model_factory import (
    CHAT_TEMPLATE,
    EMBEDDING_LENGTH,
    LAYER_COUNT,
    tensor_shapes,
    write_not_gguf,
    write_truncated_copy,
)


@pytest.fixture(scope="module")
def info(tiny_model: Path) -> ModelInfo:
    return read_model_info(tiny_model)


def test_tiny_model_metadata_is_read(info: ModelInfo, tiny_model: Path) -> None:
    assert info.path == str(tiny_model)
    assert info.file_size == tiny_model.stat().st_size
    assert info.name == "tiny-test-llama"
    assert info.architecture == "llama"
    assert info.file_type == "F32"
    assert info.context_length == 8192
    assert info.layer_count == LAYER_COUNT
    assert info.embedding_length == EMBEDDING_LENGTH
    assert info.has_chat_template is True
    assert info.chat_template == CHAT_TEMPLATE


def test_parameter_count_is_the_sum_of_the_tensor_shapes(info: ModelInfo, tiny_model: Path) -> None:
    reference = GGUFReader(tiny_model)
    n_vocab = int(reference.fields["llama.vocab_size"].contents())
    expected = sum(math.prod(shape) for shape in tensor_shapes(n_vocab).values())

    assert info.parameter_count == expected
    assert info.parameter_count == sum(t.n_elements for t in reference.tensors)


def test_summary_lines_show_the_model_for_the_command_line(info: ModelInfo) -> None:
    lines = info.summary_lines()

    assert "Name: tiny-test-llama" in lines
    assert f"Parameters: {format_parameter_count(info.parameter_count)}" in lines
    assert "Quantization: F32" in lines
    assert "Context length: 8192" in lines
    assert "Chat template: yes" in lines


def test_to_dict_is_json_ready(info: ModelInfo) -> None:
    assert json.loads(json.dumps(info.to_dict())) == info.to_dict()
    assert info.to_dict()["parameter_count"] == info.parameter_count


def test_vocab_only_file_has_no_parameters_but_its_metadata(vocab_path: Path) -> None:
    info = read_model_info(vocab_path)

    assert info.architecture == "llama"
    assert info.parameter_count == 0
    assert info.context_length == 4096
    assert info.has_chat_template is False
    assert info.chat_template is None


def test_unnamed_model_is_named_after_its_file_and_typed_by_its_tensors(tmp_path: Path) -> None:
    path = tmp_path / "my-model.gguf"
    writer = GGUFWriter(path, arch="llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    info = read_model_info(path)

    assert info.name == "my-model"
    assert info.file_type == "F16"
    assert info.parameter_count == 36
    assert info.context_length is None
    assert "Context length: unknown" in info.summary_lines()


@pytest.mark.parametrize(("n", "text"), [
    (0, "0"),
    (999, "999"),
    (17_200, "17.2 K"),
    (999_999, "1.00 M"),
    (17_234_567, "17.2 M"),
    (123_456_789, "123 M"),
    (7_241_748_480, "7.24 B"),
    (1_500_000_000_000, "1.50 T"),
])
def test_parameter_counts_are_shown_with_three_significant_digits(n: int, text: str) -> None:
    assert format_parameter_count(n) == text


# --- unusable files -----------------------------------------------------------------


def _error_for(path: Path) -> str:
    with pytest.raises(ModelFileError) as caught:
        read_model_info(path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path.parent) not in message
    return message


def test_truncated_model_is_refused_by_name(tiny_model: Path, tmp_path: Path) -> None:
    broken = write_truncated_copy(tiny_model, tmp_path / "broken.gguf")

    message = _error_for(broken)

    assert message.startswith("broken.gguf: ")
    assert "truncated" in message


def test_model_cut_inside_its_header_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "stub.gguf"
    broken.write_bytes(tiny_model.read_bytes()[:4096])

    message = _error_for(broken)

    assert message.startswith("stub.gguf: ")
    assert "truncated" in message


def test_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    message = _error_for(write_not_gguf(tmp_path / "notes.gguf"))

    assert message == "notes.gguf: not a GGUF model file"


def test_empty_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")

    assert _error_for(tmp_path / "empty.gguf") == "empty.gguf: file is empty"


def test_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()

    assert _error_for(tmp_path / "models") == "models: is a folder, not a model file"


def test_missing_file_is_refused(tmp_path: Path) -> None:
    assert _error_for(tmp_path / "gone.gguf") == "gone.gguf: no such file"


def test_unreadable_file_is_refused(tiny_model: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: the suite may run as root, for whom file modes do not deny reading.
    def deny(path: object, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(gguf_info, "open", deny, raising=False)
    locked = write_not_gguf(tmp_path / "locked.gguf")

    assert _error_for(locked) == "locked.gguf: permission denied"


# --- crafted headers: refused quickly, never a crash ---------------------------------------


def _gguf_header(tensor_count: int, kv_count: int) -> bytes:
    return struct.pack("<IIQQ", GGUF_MAGIC, 3, tensor_count, kv_count)


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _refused_within(path: Path, seconds: float) -> str:
    started = time.perf_counter()
    message = _error_for(path)
    elapsed = time.perf_counter() - started
    assert elapsed < seconds, f"took {elapsed:.1f} s"
    return message


def test_a_tensor_with_a_hundred_thousand_dimensions_is_refused_at_once(tmp_path: Path) -> None:
    # Before the bound, multiplying 100,000 64-bit dimensions took minutes (quadratic).
    dims = 100_000
    tensor = (_gguf_string("blk.0.weight") + struct.pack("<I", dims)
              + struct.pack("<Q", 2**64 - 1) * dims + struct.pack("<IQ", 0, 0))
    path = tmp_path / "wide.gguf"
    path.write_bytes(_gguf_header(1, 0) + tensor)

    message = _refused_within(path, 2.0)

    assert message == "wide.gguf: file is corrupt (a tensor has 100,000 dimensions, at most 4 are possible)"


def test_a_tensor_whose_element_count_overflows_is_refused(tmp_path: Path) -> None:
    tensor = (_gguf_string("t") + struct.pack("<I", 4) + struct.pack("<Q", 2**40) * 4
              + struct.pack("<IQ", 0, 0))
    path = tmp_path / "huge.gguf"
    path.write_bytes(_gguf_header(1, 0) + tensor)

    assert "impossible number of elements" in _refused_within(path, 2.0)


def test_arrays_nested_a_hundred_thousand_deep_are_refused_not_a_crash(tmp_path: Path) -> None:
    # Before, this raised an uncaught RecursionError out of the reader.
    depth = 100_000
    array_of_array = struct.pack("<IQ", GGUFValueType.ARRAY, 1)
    kv = (_gguf_string("evil.nested") + struct.pack("<I", GGUFValueType.ARRAY)
          + array_of_array * depth + struct.pack("<IQ", GGUFValueType.UINT8, 0))
    path = tmp_path / "nested.gguf"
    path.write_bytes(_gguf_header(0, 1) + kv)

    message = _refused_within(path, 2.0)

    assert message == "nested.gguf: file is truncated or corrupt (its header cannot be read)"


def test_arrays_of_arrays_a_few_levels_deep_are_still_read(tmp_path: Path) -> None:
    inner = struct.pack("<IQ", GGUFValueType.UINT32, 2) + struct.pack("<II", 7, 8)
    nested = struct.pack("<IQ", GGUFValueType.ARRAY, 2) + inner * 2
    kv = (_gguf_string("a.nested") + struct.pack("<I", GGUFValueType.ARRAY)
          + struct.pack("<IQ", GGUFValueType.ARRAY, 1) + nested
          + _gguf_string("general.name") + struct.pack("<I", GGUFValueType.STRING)
          + _gguf_string("after the arrays"))
    path = tmp_path / "fine.gguf"
    path.write_bytes(_gguf_header(0, 2) + kv)

    assert read_model_info(path).name == "after the arrays"
