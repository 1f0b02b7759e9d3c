from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from backend import gguf_info
from backend.errors import ModelFileError
from backend.gguf_info import ModelInfo, format_parameter_count, read_model_info
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
