"""Tiny real GGUF models for tests: llama-server loads them in well under a second.

The weights are random, but the tokenizer is a real one copied from one of
llama.cpp's vocab-only GGUF files, so prompts tokenize and replies detokenize like
those of a real model (the replies are gibberish).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter, LlamaFileType, PoolingType

EMBEDDING_LENGTH = 64
LAYER_COUNT = 2
HEAD_COUNT = 4
HEAD_COUNT_KV = 4
FEED_FORWARD_LENGTH = 128
EMBEDDING_CONTEXT_LENGTH = 512

# ChatML without special tokens in the vocabulary: the markers tokenize as plain text,
# which is all a random model needs.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def write_tiny_model(path: Path, vocab_path: Path, *, seed: int = 0, context_length: int = 8192,
                     name: str = "tiny-test-llama") -> Path:
    """Write a 2-layer, 64-wide llama with F32 random weights; about 17 MB for a 32k vocab."""
    path = Path(path)
    # Written beside the target and renamed, so an interrupted run leaves no half model.
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, arch="llama")
    _write(writer, Path(vocab_path), seed, context_length, name)
    os.replace(partial, path)
    return path


def write_tiny_embedding_model(path: Path, vocab_path: Path, *, seed: int = 0,
                               context_length: int = EMBEDDING_CONTEXT_LENGTH,
                               name: str = "tiny-test-bert") -> Path:
    """Write a 2-layer, 64-wide BERT with mean pooling, as sentence-embedding models are.

    Give it a WordPiece vocabulary (llama.cpp's ggml-vocab-bert-bge.gguf); llama-server
    started with `--embeddings` answers /v1/embeddings with EMBEDDING_LENGTH-wide vectors.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, arch="bert")
    tokenizer = tokenizer_fields(Path(vocab_path))
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    writer.add_name(name)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(context_length)
    writer.add_embedding_length(EMBEDDING_LENGTH)
    writer.add_block_count(LAYER_COUNT)
    writer.add_feed_forward_length(FEED_FORWARD_LENGTH)
    writer.add_head_count(HEAD_COUNT)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(PoolingType.MEAN)
    writer.add_vocab_size(n_vocab)
    for key, (value, value_type, item_type) in tokenizer.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    rng = np.random.default_rng(seed)
    for tensor_name, shape in bert_tensor_shapes(n_vocab, context_length).items():
        writer.add_tensor(tensor_name, random_weights(tensor_name, shape, rng))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, path)
    return path


def write_tiny_split_model(folder: Path, stem: str, vocab_path: Path, *, parts: int = 2,
                           seed: int = 0, name: str = "tiny-test-llama") -> list[Path]:
    """The same model split as llama.cpp's gguf-split does: `stem-00001-of-0000N.gguf`..."""
    folder = Path(folder)
    staging = folder / f".{stem}.partial"
    staging.mkdir(parents=True, exist_ok=True)
    n_tensors = len(tensor_shapes(1))
    writer = GGUFWriter(staging / f"{stem}.gguf", arch="llama",
                        split_max_tensors=-(-n_tensors // parts))
    _write(writer, Path(vocab_path), seed, 8192, name)
    shards = sorted(staging.glob(f"{stem}-*-of-*.gguf"))
    for shard in shards:
        os.replace(shard, folder / shard.name)
    staging.rmdir()
    return [folder / shard.name for shard in shards]


def _write(writer: GGUFWriter, vocab_path: Path, seed: int, context_length: int, name: str) -> None:
    tokenizer = tokenizer_fields(vocab_path)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    writer.add_name(name)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(context_length)
    writer.add_embedding_length(EMBEDDING_LENGTH)
    writer.add_block_count(LAYER_COUNT)
    writer.add_feed_forward_length(FEED_FORWARD_LENGTH)
    writer.add_head_count(HEAD_COUNT)
    writer.add_head_count_kv(HEAD_COUNT_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(EMBEDDING_LENGTH // HEAD_COUNT)
    writer.add_vocab_size(n_vocab)
    for key, (value, value_type, item_type) in tokenizer.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)
    for tensor_name, shape in tensor_shapes(n_vocab).items():
        writer.add_tensor(tensor_name, random_weights(tensor_name, shape, rng))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_truncated_copy(src: Path, dst: Path) -> Path:
    """The first half of `src`: a GGUF whose header is intact but whose weights are cut off."""
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[: len(data) // 2])
    return Path(dst)


def write_not_gguf(dst: Path) -> Path:
    Path(dst).write_bytes(b"This is a text file, not a GGUF model.\n" * 64)
    return Path(dst)


def tensor_shapes(n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tiny model, shapes in numpy order (rows = outputs)."""
    d, ff = EMBEDDING_LENGTH, FEED_FORWARD_LENGTH
    kv = d // HEAD_COUNT * HEAD_COUNT_KV
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, d)}
    for i in range(LAYER_COUNT):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (d, d),
            f"blk.{i}.attn_k.weight": (kv, d),
            f"blk.{i}.attn_v.weight": (kv, d),
            f"blk.{i}.attn_output.weight": (d, d),
            f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.ffn_gate.weight": (ff, d),
            f"blk.{i}.ffn_up.weight": (ff, d),
            f"blk.{i}.ffn_down.weight": (d, ff),
        }
    shapes |= {"output_norm.weight": (d,), "output.weight": (n_vocab, d)}
    return shapes


def bert_tensor_shapes(n_vocab: int, context_length: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tiny BERT (src/models/bert.cpp), shapes in numpy order."""
    d, ff = EMBEDDING_LENGTH, FEED_FORWARD_LENGTH
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (n_vocab, d),
        "token_types.weight": (2, d),
        "position_embd.weight": (context_length, d),
        "token_embd_norm.weight": (d,),
        "token_embd_norm.bias": (d,),
    }
    for i in range(LAYER_COUNT):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            shapes |= {f"blk.{i}.{part}.weight": (d, d), f"blk.{i}.{part}.bias": (d,)}
        shapes |= {
            f"blk.{i}.attn_output_norm.weight": (d,),
            f"blk.{i}.attn_output_norm.bias": (d,),
            f"blk.{i}.ffn_up.weight": (ff, d),
            f"blk.{i}.ffn_up.bias": (ff,),
            f"blk.{i}.ffn_down.weight": (d, ff),
            f"blk.{i}.ffn_down.bias": (d,),
            f"blk.{i}.layer_output_norm.weight": (d,),
            f"blk.{i}.layer_output_norm.bias": (d,),
        }
    return shapes


def tokenizer_fields(vocab_path: Path) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """The `tokenizer.*` metadata of a GGUF, as (value, type, item type) for GGUFWriter.

    Read here rather than with gguf's GGUFReader, which builds a numpy view per element:
    9 s for Qwen's 152k vocabulary and merges, where this takes a fraction of one."""
    data = Path(vocab_path).read_bytes()
    offset = 16  # magic, version, tensor count
    (kv_count,) = struct.unpack_from("<Q", data, offset)
    offset += 8
    fields: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}
    for _ in range(kv_count):
        key, offset = _string(data, offset)
        value_type = GGUFValueType(struct.unpack_from("<I", data, offset)[0])
        offset += 4
        item_type = None
        if value_type == GGUFValueType.ARRAY:
            item_type = GGUFValueType(struct.unpack_from("<I", data, offset)[0])
            (count,) = struct.unpack_from("<Q", data, offset + 4)
            offset += 12
            value: Any = []
            for _ in range(count):
                item, offset = _scalar(data, offset, item_type)
                value.append(item)
        else:
            value, offset = _scalar(data, offset, value_type)
        if key.startswith("tokenizer."):
            fields[key] = (value, value_type, item_type)
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"{Path(vocab_path).name} has no tokenizer vocabulary")
    return fields


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


def _string(data: bytes, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    end = offset + 8 + length
    return data[offset + 8:end].decode("utf-8"), end


def _scalar(data: bytes, offset: int, value_type: GGUFValueType) -> tuple[Any, int]:
    if value_type == GGUFValueType.STRING:
        return _string(data, offset)
    fmt = _SCALAR_FORMATS.get(value_type)
    if fmt is None:
        raise ValueError(f"unexpected GGUF value type {value_type!r} in a tokenizer field")
    return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)


def random_weights(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if name.endswith("norm.bias"):
        return np.zeros(shape, dtype=np.float32)
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)
