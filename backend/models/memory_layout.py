"""What a model keeps in memory beside its weights, layer by layer, read from its GGUF
header by the pinned llama.cpp's own rules.

A dense model's layers each keep a key and a value for every token of the context.  The
models people run are not all dense: most layers of Gemma 2/3/4, gpt-oss or Cohere 2 keep
only a sliding window of recent tokens (SWA); hybrids (Qwen3.5/3.6's `qwen35`, Qwen3-Next,
Granite 4 H, LFM2, Jamba, Nemotron-H) keep a fixed recurrent state in most layers and
full attention in a few; Mamba and RWKV keep only a state.  Which layers do what is
partly in the header (the window, a per-layer pattern, the recurrent layers, per-layer
KV head counts) and partly in llama.cpp's code for each architecture
(src/models/<arch>.cpp `load_arch_hparams`: a default pattern such as Gemma 3's 5 sliding
layers in 6, a default window); the tables below are that code's, for the architectures
it names.  Another architecture is counted as dense (every layer with KV heads keeps the
whole context), as llama.cpp itself sizes one with no sliding window or state, and
`rules_known` says so.

`backend.models.fit` turns a layout and the engine's flags into bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["KvLayer", "MemoryLayout", "memory_layout"]


@dataclass(frozen=True)
class KvLayer:
    """One layer that keeps a KV cache: its key and value widths per token (elements,
    KV heads x head width; a value width of 0 for MLA, which keeps no separate values)
    and whether it keeps only the sliding window."""

    key_width: int
    value_width: int
    sliding: bool = False


@dataclass(frozen=True)
class MemoryLayout:
    """The layers' memory: what each KV layer keeps per token, the sliding window, and
    the recurrent state each sequence keeps (f32 values, every recurrent layer's together:
    llama.cpp keeps recurrent state in f32 whatever the cache type)."""

    kv_layers: tuple[KvLayer, ...]
    sliding_window: int = 0  #: tokens the sliding layers keep (0: no sliding layers)
    recurrent_layers: int = 0
    recurrent_state_values: int = 0  #: per sequence, all recurrent layers together
    layer_count: int = 0  #: the model's layers (without next-token-prediction heads)
    expert_count: int = 0
    expert_used_count: int = 0
    #: The architecture's rules are known here; else it is counted as dense.
    rules_known: bool = True

    @property
    def sliding_layers(self) -> int:
        return sum(1 for layer in self.kv_layers if layer.sliding)

    @property
    def full_layers(self) -> int:
        return sum(1 for layer in self.kv_layers if not layer.sliding)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the counts people read and the description."""
        return {"kv_layers": [dataclasses.asdict(layer) for layer in self.kv_layers],
                "full_layers": self.full_layers, "sliding_layers": self.sliding_layers,
                "sliding_window": self.sliding_window, "recurrent_layers": self.recurrent_layers,
                "recurrent_state_values": self.recurrent_state_values,
                "layer_count": self.layer_count, "expert_count": self.expert_count,
                "expert_used_count": self.expert_used_count, "rules_known": self.rules_known,
                "description": self.describe()}

    def describe(self) -> str:
        """For people: "15 of 18 layers keep a 512-token sliding window; 8 experts, 2 used"."""
        n = self.layer_count or len(self.kv_layers)
        parts = []
        if self.sliding_layers:
            parts.append(f"{self.sliding_layers} of {n} layers keep a "
                         f"{self.sliding_window:,}-token sliding window")
        if self.recurrent_layers:
            share = f"all {n}" if self.recurrent_layers >= n else f"{self.recurrent_layers} of {n}"
            parts.append(f"{share} layers keep a fixed recurrent state")
        if not parts:
            full = len(self.kv_layers)
            parts.append("no layer keeps a context (it computes each input whole)" if not full else
                         f"all {full} layers keep the whole context" if full == n else
                         f"{full} of {n} layers keep the whole context")
        if self.expert_count:
            parts.append(f"{self.expert_count} experts, {self.expert_used_count} used per token")
        if not self.rules_known:
            parts.append("counted as dense: its architecture's rules are not known here")
        return "; ".join(parts)


def memory_layout(architecture: str, metadata: Mapping[str, Any]) -> MemoryLayout | None:
    """The layout of a model of `architecture` from its header's `metadata` (per-layer
    numbers as tuples); None when the header lacks the layer count or width."""
    hp = _Hparams(architecture, metadata)
    if hp.layer_count_all <= 0 or hp.embedding_length <= 0:
        return None
    n_layer = hp.layer_count
    if architecture in _NO_MEMORY:
        return MemoryLayout(kv_layers=(), layer_count=n_layer, expert_count=hp.integer("expert_count"))
    recurrent = _recurrent_layers(hp)
    if hp.head_count <= 0 and not any(recurrent):
        return None  # neither attention heads nor a state: nothing to size
    sliding, window = _sliding_layers(hp)
    kv_from_start = _kv_from_start(hp)
    attention_too = architecture == "falcon-h1"  # every layer both attends and recurs
    kv_layers = []
    for il in range(n_layer):
        if il >= kv_from_start or (recurrent[il] and not attention_too):
            continue
        heads_kv = hp.head_count_kv(il)
        if heads_kv == 0:
            continue  # no attention here (a hybrid's other layers): nothing cached
        if architecture in ("nemotron_h", "nemotron_h_moe") and hp.feed_forward_length(il) != 0:
            continue  # a feed-forward layer: neither attention nor state
        swa = sliding[il]
        key = (hp.key_length_swa if swa else hp.key_length) * heads_kv
        value = 0 if hp.mla else (hp.value_length_swa if swa else hp.value_length) * heads_kv
        kv_layers.append(KvLayer(key, value, swa))
    recurrent_count = sum(recurrent[:hp.layer_count_all])
    state = recurrent_count * (_state_r(hp) + _state_s(hp)) if recurrent_count else 0
    return MemoryLayout(
        kv_layers=tuple(kv_layers),
        sliding_window=window if any(layer.sliding for layer in kv_layers) else 0,
        recurrent_layers=recurrent_count,
        recurrent_state_values=state,
        layer_count=n_layer,
        expert_count=hp.integer("expert_count"),
        expert_used_count=max(hp.per_layer("expert_used_count", 0), default=0),
        rules_known=architecture in _KNOWN,
    )


# --- the architectures' rules ---------------------------------------------------------------


@dataclass(frozen=True)
class _SwaRule:
    """How an architecture's code sets its sliding layers (src/models/<arch>.cpp)."""

    pattern: int | None  #: load_swa_pattern(ml, pattern); None: the header's array only
    dense_first: bool = False  #: the full layer opens each period rather than closing it
    needs_window: bool = False  #: sliding only when the header's window is > 0
    default_window: int = 0  #: the window when the header gives none
    fixed_window: int = 0  #: the window whatever the header says


_SWA_RULES: dict[str, _SwaRule] = {
    "gemma2": _SwaRule(2, default_window=4096),
    "gemma3": _SwaRule(6, needs_window=True),
    "gemma3n": _SwaRule(5),
    "gemma4": _SwaRule(None),
    "cohere2": _SwaRule(4),
    "cohere2moe": _SwaRule(4, dense_first=True),
    "gpt-oss": _SwaRule(2),
    "olmo2": _SwaRule(4, needs_window=True),
    "exaone-moe": _SwaRule(4, default_window=128),
    "afmoe": _SwaRule(4, needs_window=True),
    "mellum": _SwaRule(4, needs_window=True),
    "plamo3": _SwaRule(8, needs_window=True),
    "muse-glimmer": _SwaRule(4),
    "laguna": _SwaRule(4, dense_first=True, needs_window=True),
    "smallthinker": _SwaRule(4, dense_first=True, needs_window=True, fixed_window=4096),
    "mimo2": _SwaRule(None),
    "step35": _SwaRule(None),
    "granite_swa": _SwaRule(None),
    "maple": _SwaRule(None),
    "spark2_5": _SwaRule(None),
    "dots3note": _SwaRule(None),
}
#: Hybrids whose recurrent layers are those with no KV heads.
_RECURRENT_WITHOUT_KV_HEADS = frozenset({
    "jamba", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "kimi-linear", "bailingmoe3", "kimi-k3",
    "glm5-next"})
#: Hybrids whose attention layers are every n-th (`full_attention_interval`, or the
#: header's `attention.recurrent_layers`), with llama.cpp's default n.
_RECURRENT_BY_INTERVAL = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4, "qwen4exp": 4, "minimax-01": 8}
#: Architectures that keep only a recurrent state.
_RECURRENT_ONLY = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
_HYBRID_OTHER = frozenset({"nemotron_h", "nemotron_h_moe", "falcon-h1"})
#: Architectures llama.cpp gives no KV cache (encoders, diffusion models: create_memory).
_NO_MEMORY = frozenset({
    "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2", "jina-bert-v3",
    "eurobert", "gemma-embedding", "wavtokenizer-dec", "dream", "llada", "llada-moe", "rnd1"})
#: Dense architectures people run, whose every layer keeps the context.
_DENSE = frozenset({
    "llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "qwen3vl", "qwen3vlmoe", "mistral3",
    "phi3", "phi2", "granite", "granitemoe", "deepseek", "deepseek2", "glm4", "glm4moe", "olmo",
    "olmoe", "starcoder2", "gemma", "command-r", "internlm2", "minimax-m2", "seed_oss", "ernie4_5",
    "ernie4_5-moe", "smollm3", "exaone", "apertus", "hunyuan-moe", "hunyuan-dense"})
_KNOWN = frozenset(_SWA_RULES) | _RECURRENT_WITHOUT_KV_HEADS | frozenset(_RECURRENT_BY_INTERVAL) \
    | _RECURRENT_ONLY | _HYBRID_OTHER | _NO_MEMORY | _DENSE | {"llama4", "exaone4"}


class _Hparams:
    """The header's numbers as llama_hparams reads them (defaults included)."""

    def __init__(self, architecture: str, metadata: Mapping[str, Any]) -> None:
        self.arch = architecture
        self.metadata = metadata
        self.layer_count_all = self.integer("block_count")
        self.layer_count = max(0, self.layer_count_all - self.integer("nextn_predict_layers"))
        self.embedding_length = self.integer("embedding_length")
        heads = self.per_layer("attention.head_count", 0)
        self.head_count = heads[0] if heads else 0
        full_k = full_v = 0
        if self.head_count > 0:
            full_k = full_v = self.embedding_length // self.head_count
        self.key_length = self.integer("attention.key_length", full_k)
        self.value_length = self.integer("attention.value_length", full_v)
        self.key_length_swa = self.integer("attention.key_length_swa", self.key_length)
        self.value_length_swa = self.integer("attention.value_length_swa", self.value_length)
        self.mla = self.integer("attention.key_length_mla") > 0

    def value(self, key: str) -> Any:
        return self.metadata.get(f"{self.arch}.{key}")

    def integer(self, key: str, default: int = 0) -> int:
        value = self.value(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    def per_layer(self, key: str, default: int) -> list[int]:
        """A scalar for every layer, or the header's per-layer array (get_key_or_arr)."""
        value = self.value(key)
        if isinstance(value, tuple):
            numbers = [int(v) for v in value[:self.layer_count_all]]
            return numbers + [default] * (self.layer_count_all - len(numbers))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return [int(value)] * self.layer_count_all
        return [default] * self.layer_count_all

    def head_count_kv(self, il: int) -> int:
        heads = self.per_layer("attention.head_count", 0)
        kv = self.per_layer("attention.head_count_kv", -1)
        return heads[il] if kv[il] < 0 else kv[il]

    def feed_forward_length(self, il: int) -> int:
        return self.per_layer("feed_forward_length", 0)[il]

    def layer_flags(self, key: str) -> list[bool] | None:
        """A per-layer array of flags, padded with False; None when absent or not one."""
        value = self.value(key)
        if not isinstance(value, tuple):
            return None
        flags = [bool(v) for v in value[:self.layer_count_all]]
        return flags + [False] * (self.layer_count_all - len(flags))


def _recurrent_layers(hp: _Hparams) -> list[bool]:
    n_all, n_layer = hp.layer_count_all, hp.layer_count
    if hp.arch in _RECURRENT_ONLY or hp.arch == "falcon-h1":
        return [True] * n_all
    if hp.arch in _RECURRENT_WITHOUT_KV_HEADS:
        return [il < n_layer and hp.head_count_kv(il) == 0 for il in range(n_all)]
    if hp.arch in ("nemotron_h", "nemotron_h_moe"):
        return [il < n_layer and hp.head_count_kv(il) == 0 and hp.feed_forward_length(il) == 0
                for il in range(n_all)]
    if hp.arch in _RECURRENT_BY_INTERVAL:
        listed = hp.layer_flags("attention.recurrent_layers")
        if listed is not None:
            return listed
        every = hp.integer("full_attention_interval", _RECURRENT_BY_INTERVAL[hp.arch]) or 1
        return [il < n_layer and (il + 1) % every != 0 for il in range(n_all)]
    return [False] * n_all


def _sliding_layers(hp: _Hparams) -> tuple[list[bool], int]:
    """Which layers slide, and the window (llama.cpp's `load_swa_pattern` and the
    architectures' code around it)."""
    n_all, n_layer = hp.layer_count_all, hp.layer_count
    none = [False] * n_all
    window = hp.integer("attention.sliding_window")
    listed = hp.layer_flags("attention.sliding_window_pattern")
    if hp.arch == "llama4":  # chunked attention: 3 chunked layers in 4, 8,192-token chunks
        if hp.value("attention.sliding_window") == 0:
            return none, 0
        return _pattern(listed, hp.integer("attention.sliding_window_pattern", 4), False,
                        n_layer, n_all), 8192
    if hp.arch == "exaone4":  # the 32B slides 3 layers in 4; the header's window wins
        if hp.layer_count != 64:
            return none, 0
        return _pattern(listed, hp.integer("attention.sliding_window_pattern", 4), False,
                        n_layer, n_all), window or 4096
    if hp.arch in ("lfm2", "lfm2moe"):
        if window <= 0:
            return none, 0
        recurrent = _recurrent_layers(hp)
        return [il < n_layer and not recurrent[il] for il in range(n_all)], window
    rule = _SWA_RULES.get(hp.arch)
    if rule is None or (rule.needs_window and window <= 0):
        return none, 0
    window = rule.fixed_window or window or rule.default_window
    if rule.pattern is None:
        return (listed or none), window
    return _pattern(listed, hp.integer("attention.sliding_window_pattern", rule.pattern),
                    rule.dense_first, n_layer, n_all), window


def _pattern(listed: list[bool] | None, n_pattern: int, dense_first: bool,
             n_layer: int, n_all: int) -> list[bool]:
    """llama_hparams::set_swa_pattern, unless the header lists the layers."""
    if listed is not None:
        return listed
    if dense_first:
        return [il < n_layer and (n_pattern == 0 or il % n_pattern != 0) for il in range(n_all)]
    return [il < n_layer and (n_pattern == 0 or il % n_pattern < n_pattern - 1) for il in range(n_all)]


def _kv_from_start(hp: _Hparams) -> int:
    """Layers from this one on share an earlier layer's cache (Gemma 3n and 4)."""
    if hp.arch == "gemma3n":
        return 20
    if hp.arch == "gemma4":
        return hp.layer_count_all - hp.integer("attention.shared_kv_layers")
    return hp.layer_count_all


def _state_r(hp: _Hparams) -> int:
    """llama_hparams::n_embd_r: the convolution (or token shift) columns a layer keeps."""
    d_conv = hp.integer("ssm.conv_kernel")
    if hp.integer("wkv.head_size"):
        return hp.integer("token_shift_count", 2) * hp.embedding_length
    if hp.integer("shortconv.l_cache"):
        return hp.embedding_length * (hp.integer("shortconv.l_cache") - 1)
    if hp.integer("kda.head_dim"):
        return 3 * (d_conv - 1 if d_conv > 0 else 3) * hp.head_count * hp.integer("kda.head_dim")
    inner = hp.integer("ssm.inner_size") + 2 * hp.integer("ssm.group_count") * hp.integer("ssm.state_size")
    return (d_conv - 1 if d_conv > 0 else 0) * inner


def _state_s(hp: _Hparams) -> int:
    """llama_hparams::n_embd_s: the state proper (Mamba's ssm state, a delta net's matrix)."""
    if hp.integer("wkv.head_size"):
        return hp.embedding_length * hp.integer("wkv.head_size")
    if hp.integer("kda.head_dim"):
        return hp.integer("kda.head_dim") ** 2 * hp.head_count
    if hp.arch == "minimax-01":
        return hp.key_length ** 2 * hp.head_count
    return hp.integer("ssm.state_size") * hp.integer("ssm.inner_size")
