"""Tiny real GGUF models of the families people run that are not dense: a hybrid whose
recurrent layers keep a fixed state (llama.cpp's `qwen35`, as Qwen3.5 and 3.6 are) and a
sliding-window mixture of experts (`gpt-oss`).

Like tests/model_factory.py's llama, the weights are random and the tokenizer is a real
one copied from a vocab-only GGUF of the pinned llama.cpp sources, so prompts tokenize
as they would for a real model and the replies are gibberish.  The metadata keys, tensor
names and shapes are those the pinned sources read: src/models/qwen35.cpp and
src/models/openai-moe.cpp (`load_arch_hparams`, `load_arch_tensors`), the names in
src/llama-arch.cpp.  A shape {a, b} there is ggml's order (a is the row width), so the
numpy shapes below are reversed.  Each loads in llama-server in well under a second.

Their memory is chosen to be large enough to measure (the engine logs sizes in MiB with
two decimals) and small enough to load fast:

- the hybrid, 4 layers: 3 gated-delta-net layers then 1 full-attention layer
  (`full_attention_interval` 4, as Qwen3.5's converter writes it); each recurrent layer
  keeps 268 KiB of state per sequence (f32: a 128 x 512 delta-net state and 3 x 1,024
  convolution columns), the attention layer 1 KiB per token of KV cache (f16);
- the MoE, 4 layers alternating a 128-token sliding window with full attention (gpt-oss's
  pattern of 2), 4 experts of which 2 are used, attention sinks; 256 bytes per token per
  layer at f16.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter, LlamaFileType

from tests.model_factory import CHAT_TEMPLATE, random_weights, tokenizer_fields

__all__ = [
    "MARKER_CHAT_TEMPLATE",
    "HybridShape",
    "SwaMoeShape",
    "hybrid_tensor_shapes",
    "swa_moe_tensor_shapes",
    "write_hybrid_model",
    "write_swa_moe_model",
]


class HybridShape:
    """The tiny `qwen35`'s hyperparameters (names as in llama_hparams)."""

    context_length = 32768
    embedding_length = 64
    layer_count = 4
    full_attention_interval = 4  # layers 0-2 recurrent, layer 3 attention
    head_count = 4
    head_count_kv = 2
    head_length = 128  # key and value width of the attention layer
    rope_dimension_count = 32  # a quarter of the head, as Qwen3.5's partial rotary factor
    rope_sections = (6, 5, 5, 0)  # sums to half the rotary dimensions (imrope)
    feed_forward_length = 128
    ssm_conv_kernel = 4
    ssm_state_size = 128  # the key (and value) head width of the delta net
    ssm_group_count = 2  # key heads
    ssm_time_step_rank = 4  # value heads
    ssm_inner_size = ssm_state_size * ssm_time_step_rank  # value heads x their width

    @classmethod
    def recurrent(cls, layer: int) -> bool:
        return (layer + 1) % cls.full_attention_interval != 0


class SwaMoeShape:
    """The tiny `gpt-oss`'s hyperparameters."""

    context_length = 32768
    embedding_length = 64
    layer_count = 4
    sliding_window = 128  # as gpt-oss's
    head_count = 4
    head_count_kv = 2
    head_length = 32  # key, value and rotary width (gpt-oss: n_rot is the head width)
    expert_count = 4
    expert_used_count = 2
    expert_feed_forward_length = 64

    @staticmethod
    def sliding(layer: int) -> bool:
        # llama_hparams::set_swa_pattern(2): every other layer, the first sliding.
        return layer % 2 < 1


#: Phi-3's chat markers (special tokens of its vocabulary), for every role: Phi-3's own
#: template drops system messages, and agents' system prompts are the head sessions share.
MARKER_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def write_hybrid_model(path: Path, vocab_path: Path, *, seed: int = 0,
                       name: str = "tiny-test-qwen35") -> Path:
    """Write the hybrid; give it llama.cpp's ggml-vocab-phi-3.gguf (a 32k SentencePiece
    vocabulary whose chat markers are special tokens; Qwen's own 152k one takes llama.cpp
    2 s to load, where this one loads in 0.2).  About 7 MB."""
    h = HybridShape
    tokenizer = tokenizer_fields(Path(vocab_path))
    tokenizer.pop("tokenizer.chat_template", None)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, arch="qwen35")
    writer.add_name(name)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_context_length(h.context_length)
    writer.add_embedding_length(h.embedding_length)
    writer.add_block_count(h.layer_count)
    writer.add_feed_forward_length(h.feed_forward_length)
    writer.add_head_count(h.head_count)
    writer.add_head_count_kv(h.head_count_kv)
    writer.add_key_length(h.head_length)
    writer.add_value_length(h.head_length)
    writer.add_rope_dimension_count(h.rope_dimension_count)
    writer.add_rope_dimension_sections(list(h.rope_sections))
    writer.add_rope_freq_base(10_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_ssm_conv_kernel(h.ssm_conv_kernel)
    writer.add_ssm_state_size(h.ssm_state_size)
    writer.add_ssm_group_count(h.ssm_group_count)
    writer.add_ssm_time_step_rank(h.ssm_time_step_rank)
    writer.add_ssm_inner_size(h.ssm_inner_size)
    writer.add_full_attention_interval(h.full_attention_interval)
    _finish(writer, tokenizer, MARKER_CHAT_TEMPLATE, hybrid_tensor_shapes(n_vocab), seed)
    os.replace(partial, path)
    return path


def write_swa_moe_model(path: Path, vocab_path: Path, *, seed: int = 0,
                        name: str = "tiny-test-gpt-oss") -> Path:
    """Write the sliding-window MoE; give it llama.cpp's ggml-vocab-gpt-2.gguf (a 50k BPE
    vocabulary without chat tokens: the ChatML markers of the template tokenize as text,
    as the tiny llama's do).  About 15 MB."""
    tokenizer = tokenizer_fields(Path(vocab_path))
    tokenizer.pop("tokenizer.chat_template", None)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    m = SwaMoeShape
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, arch="gpt-oss")
    writer.add_name(name)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_context_length(m.context_length)
    writer.add_embedding_length(m.embedding_length)
    writer.add_block_count(m.layer_count)
    writer.add_feed_forward_length(m.expert_feed_forward_length)
    writer.add_head_count(m.head_count)
    writer.add_head_count_kv(m.head_count_kv)
    writer.add_key_length(m.head_length)
    writer.add_value_length(m.head_length)
    writer.add_rope_freq_base(150_000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_sliding_window(m.sliding_window)
    writer.add_expert_count(m.expert_count)
    writer.add_expert_used_count(m.expert_used_count)
    writer.add_expert_feed_forward_length(m.expert_feed_forward_length)
    _finish(writer, tokenizer, CHAT_TEMPLATE, swa_moe_tensor_shapes(n_vocab), seed)
    os.replace(partial, path)
    return path


def hybrid_tensor_shapes(n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the hybrid (src/models/qwen35.cpp), numpy order.  The output is
    tied to the token embeddings (`output` is optional there)."""
    h = HybridShape
    d, ff = h.embedding_length, h.feed_forward_length
    q = h.head_length * h.head_count
    kv = h.head_length * h.head_count_kv
    key_dim = h.ssm_state_size * h.ssm_group_count
    value_dim = h.ssm_inner_size
    conv_dim = 2 * key_dim + value_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, d)}
    for i in range(h.layer_count):
        b = f"blk.{i}"
        shapes |= {f"{b}.attn_norm.weight": (d,), f"{b}.post_attention_norm.weight": (d,)}
        if h.recurrent(i):
            shapes |= {
                f"{b}.attn_qkv.weight": (conv_dim, d),
                f"{b}.attn_gate.weight": (value_dim, d),
                f"{b}.ssm_conv1d.weight": (conv_dim, h.ssm_conv_kernel),
                f"{b}.ssm_dt.bias": (h.ssm_time_step_rank,),
                f"{b}.ssm_a": (h.ssm_time_step_rank,),
                f"{b}.ssm_beta.weight": (h.ssm_time_step_rank, d),
                f"{b}.ssm_alpha.weight": (h.ssm_time_step_rank, d),
                f"{b}.ssm_norm.weight": (h.ssm_state_size,),
                f"{b}.ssm_out.weight": (d, value_dim),
            }
        else:
            shapes |= {
                f"{b}.attn_q.weight": (2 * q, d),  # the query and its gate
                f"{b}.attn_k.weight": (kv, d),
                f"{b}.attn_v.weight": (kv, d),
                f"{b}.attn_output.weight": (d, q),
                f"{b}.attn_q_norm.weight": (h.head_length,),
                f"{b}.attn_k_norm.weight": (h.head_length,),
            }
        shapes |= {
            f"{b}.ffn_gate.weight": (ff, d),
            f"{b}.ffn_up.weight": (ff, d),
            f"{b}.ffn_down.weight": (d, ff),
        }
    shapes |= {"output_norm.weight": (d,)}
    return shapes


def swa_moe_tensor_shapes(n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the MoE (src/models/openai-moe.cpp), numpy order."""
    m = SwaMoeShape
    d, ff, experts = m.embedding_length, m.expert_feed_forward_length, m.expert_count
    q = m.head_length * m.head_count
    kv = m.head_length * m.head_count_kv
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, d)}
    for i in range(m.layer_count):
        b = f"blk.{i}"
        shapes |= {
            f"{b}.attn_norm.weight": (d,),
            f"{b}.post_attention_norm.weight": (d,),
            f"{b}.attn_q.weight": (q, d),
            f"{b}.attn_k.weight": (kv, d),
            f"{b}.attn_v.weight": (kv, d),
            f"{b}.attn_q.bias": (q,),
            f"{b}.attn_k.bias": (kv,),
            f"{b}.attn_v.bias": (kv,),
            f"{b}.attn_output.weight": (d, q),
            f"{b}.attn_output.bias": (d,),
            f"{b}.attn_sinks.weight": (m.head_count,),
            f"{b}.ffn_gate_inp.weight": (experts, d),
            f"{b}.ffn_gate_inp.bias": (experts,),
            f"{b}.ffn_gate_exps.weight": (experts, ff, d),
            f"{b}.ffn_gate_exps.bias": (experts, ff),
            f"{b}.ffn_up_exps.weight": (experts, ff, d),
            f"{b}.ffn_up_exps.bias": (experts, ff),
            f"{b}.ffn_down_exps.weight": (experts, d, ff),
            f"{b}.ffn_down_exps.bias": (experts, d),
        }
    shapes |= {"output_norm.weight": (d,), "output.weight": (n_vocab, d)}
    return shapes


def _finish(writer: GGUFWriter, tokenizer: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]],
            template: str, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    writer.add_vocab_size(len(tokenizer["tokenizer.ggml.tokens"][0]))
    for key, (value, value_type, item_type) in tokenizer.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    writer.add_chat_template(template)
    rng = np.random.default_rng(seed)
    for tensor_name, shape in shapes.items():
        writer.add_tensor(tensor_name, _weights(tensor_name, shape, rng))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _weights(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith(".ssm_a"):
        # A = -exp(A_log) < 0, as the converter writes it: a state that decays, so that long
        # prompts stay finite.
        return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
    weights = random_weights(name, shape, rng)
    if name in ("token_embd.weight", "output.weight"):
        return weights.astype(np.float16)  # half the file; the vocabulary is most of it
    return weights
