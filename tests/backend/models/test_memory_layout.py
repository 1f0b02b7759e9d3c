"""What each layer keeps, from the header, by the pinned llama.cpp's rules per architecture.
(The sizes these give are checked against the real engine in test_fit.py.)"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType, GGUFWriter

from backend.models.gguf_info import read_model_info
from backend.models.memory_layout import KvLayer, memory_layout
from tests.family_models import HybridShape, SwaMoeShape
from tests.not_none import not_none


def header(arch: str, **keys: Any) -> dict[str, Any]:
    """`arch.`-prefixed metadata, as the GGUF reader gives it (arrays as tuples)."""
    return {f"{arch}.{key.replace('__', '.')}": value for key, value in keys.items()}


def test_gemma3_slides_five_layers_in_six_by_its_code_not_its_header(gemma3_model):
    layout = not_none(read_model_info(gemma3_model).memory)
    # The header says only the window (512): the pattern of 6 is gemma3.cpp's.
    assert [layer.sliding for layer in layout.kv_layers] == [il % 6 < 5 for il in range(18)]
    assert (layout.sliding_window, layout.full_layers, layout.recurrent_layers) == (512, 3, 0)
    assert layout.kv_layers[0] == KvLayer(256, 256, sliding=True)  # 1 KV head of 256 + 256


def test_gemma3_without_a_window_keeps_every_layer_whole():
    layout = not_none(memory_layout("gemma3", header(
        "gemma3", block_count=6, embedding_length=64, attention__head_count=4)))
    assert layout.sliding_layers == 0 and layout.full_layers == 6


def test_the_generated_hybrid_keeps_a_state_in_three_layers_and_the_context_in_one(hybrid_model):
    h = HybridShape
    layout = not_none(read_model_info(hybrid_model).memory)
    assert layout.kv_layers == (KvLayer(h.head_length * h.head_count_kv, h.head_length * h.head_count_kv),)
    assert layout.recurrent_layers == 3
    # llama_hparams: n_embd_r = (d_conv - 1) x (d_inner + 2 x groups x d_state); n_embd_s =
    # d_state x d_inner; for each recurrent layer.
    conv = (h.ssm_conv_kernel - 1) * (h.ssm_inner_size + 2 * h.ssm_group_count * h.ssm_state_size)
    assert layout.recurrent_state_values == 3 * (conv + h.ssm_state_size * h.ssm_inner_size)


def test_the_generated_moe_alternates_sliding_and_full_layers(swa_moe_model):
    m = SwaMoeShape
    layout = not_none(read_model_info(swa_moe_model).memory)
    assert [layer.sliding for layer in layout.kv_layers] == [True, False, True, False]
    assert (layout.sliding_window, layout.expert_count, layout.expert_used_count) == (
        m.sliding_window, m.expert_count, m.expert_used_count)
    assert layout.describe() == ("2 of 4 layers keep a 128-token sliding window; "
                                 "4 experts, 2 used per token")


def test_a_listed_pattern_and_recurrent_layers_in_the_header_win(tmp_path):
    # Qwen3.5's converter may list the recurrent layers rather than give an interval; the
    # GGUF reader reads such short arrays (it skips the vocabulary's).
    path = tmp_path / "listed.gguf"
    writer = GGUFWriter(path, arch="qwen35")
    writer.add_block_count(4)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_value("qwen35.attention.recurrent_layers", [True, False, True, False],
                         GGUFValueType.ARRAY, sub_type=GGUFValueType.BOOL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    layout = not_none(read_model_info(path).memory)
    assert (layout.recurrent_layers, layout.full_layers) == (2, 2)


def test_gemma4_lists_its_sliding_layers_and_shares_the_last_layers_caches():
    pattern = (True, True, True, True, False) * 2
    layout = not_none(memory_layout("gemma4", header(
        "gemma4", block_count=10, embedding_length=64, attention__head_count=4,
        attention__head_count_kv=1, attention__key_length=512, attention__value_length=512,
        attention__key_length_swa=256, attention__value_length_swa=256,
        attention__sliding_window=1024, attention__sliding_window_pattern=pattern,
        attention__shared_kv_layers=4)))
    # Layers 6..9 read the caches of earlier ones: 6 layers keep their own.
    assert layout.kv_layers == (KvLayer(256, 256, True),) * 4 + (KvLayer(512, 512),) + (
        KvLayer(256, 256, True),)


def test_hybrids_whose_recurrent_layers_have_no_kv_heads():
    kv_heads = (0, 0, 8, 0, 0, 8)
    for arch in ("lfm2", "granitehybrid", "jamba"):
        layout = not_none(memory_layout(arch, header(
            arch, block_count=6, embedding_length=1024, attention__head_count=16,
            attention__head_count_kv=kv_heads, ssm__conv_kernel=4, ssm__inner_size=2048,
            ssm__state_size=128, ssm__group_count=1, shortconv__l_cache=3 if arch == "lfm2" else 0)))
        assert (layout.recurrent_layers, layout.full_layers) == (4, 2), arch
    lfm2 = not_none(memory_layout("lfm2", header(
        "lfm2", block_count=6, embedding_length=1024, attention__head_count=16,
        attention__head_count_kv=kv_heads, shortconv__l_cache=3)))
    assert lfm2.recurrent_state_values == 4 * 1024 * 2  # n_embd x (l_cache - 1) a layer


def test_next_token_prediction_layers_keep_no_cache_of_the_main_model():
    layout = not_none(memory_layout("qwen35", header(
        "qwen35", block_count=5, nextn_predict_layers=1, embedding_length=64,
        attention__head_count=4, attention__head_count_kv=2, full_attention_interval=4)))
    assert (layout.layer_count, layout.recurrent_layers, layout.full_layers) == (4, 3, 1)


def test_mla_keeps_a_compressed_key_and_no_values():
    layout = not_none(memory_layout("deepseek2", header(
        "deepseek2", block_count=2, embedding_length=7168, attention__head_count=128,
        attention__head_count_kv=1, attention__key_length=576, attention__value_length=512,
        attention__key_length_mla=192, attention__value_length_mla=128)))
    assert layout.kv_layers == (KvLayer(576, 0),) * 2


def test_mamba_and_rwkv_keep_only_a_state():
    mamba = not_none(memory_layout("mamba2", header(
        "mamba2", block_count=2, embedding_length=768, ssm__conv_kernel=4, ssm__inner_size=1536,
        ssm__state_size=128, ssm__group_count=1)))
    assert mamba.kv_layers == () and mamba.recurrent_layers == 2
    assert mamba.recurrent_state_values == 2 * (3 * (1536 + 2 * 128) + 128 * 1536)
    rwkv = not_none(memory_layout("rwkv7", header(
        "rwkv7", block_count=3, embedding_length=512, wkv__head_size=64)))
    assert rwkv.recurrent_state_values == 3 * (2 * 512 + 512 * 64)
    assert rwkv.describe() == "all 3 layers keep a fixed recurrent state"


def test_defaults_of_the_code_gemma2_window_gpt_oss_pattern_llama4_chunks():
    gemma2 = not_none(memory_layout("gemma2", header(
        "gemma2", block_count=4, embedding_length=64, attention__head_count=4)))
    assert (gemma2.sliding_window, gemma2.sliding_layers) == (4096, 2)
    llama4 = not_none(memory_layout("llama4", header(
        "llama4", block_count=8, embedding_length=64, attention__head_count=4)))
    assert (llama4.sliding_window, llama4.sliding_layers) == (8192, 6)
    no_chunks = not_none(memory_layout("llama4", header(
        "llama4", block_count=8, embedding_length=64, attention__head_count=4,
        attention__sliding_window=0)))
    assert no_chunks.sliding_layers == 0


def test_an_encoder_keeps_nothing_and_an_unknown_architecture_is_counted_as_dense():
    bert = not_none(memory_layout("bert", header(
        "bert", block_count=2, embedding_length=64, attention__head_count=4)))
    assert bert.kv_layers == () and bert.describe().startswith("no layer keeps a context")
    unknown = not_none(memory_layout("future-arch", header(
        "future-arch", block_count=3, embedding_length=64, attention__head_count=4,
        attention__sliding_window=128)))
    assert unknown.full_layers == 3 and not unknown.rules_known
    assert "counted as dense" in unknown.describe()
    assert memory_layout("llama", header("llama", embedding_length=64)) is None
