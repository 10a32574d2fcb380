"""Model shapes: one dataclass and the named presets.

A `ModelConfig` is everything needed to build one of our decoders: the Llama family (Llama 2/3.x, Mistral,
Mathstral, Mixtral-style MoE when it has experts) or GPT-OSS (`architecture="gpt_oss"`). Field names follow
our code; `phalanx.models.hf_config` maps them to and from Hugging Face `config.json`.
Knows nothing about parallelism, data or training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

# Fields a run may change when it resumes from a checkpoint of the same model: they do not change what the
# weights mean (the context length the model accepts, the init used before any step, MoE loss/capacity knobs).
RESUMABLE_CHANGES = frozenset({"max_seq_len", "init_std", "router_aux_loss_coef", "capacity_factor"})
ARCHITECTURES = ("llama", "gpt_oss")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SLIDING_WINDOW_LAYERS = ("all", "even")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    sliding_window: int | None = None
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Mixture of experts (n_experts == 0: dense SwiGLU MLP in every block).
    n_experts: int = 0
    top_k: int = 2
    router_aux_loss_coef: float = 0.02
    # Expert capacity: None = dropless (every routed pair is computed); a factor f lets each expert take
    # at most ceil(f × tokens × top_k / n_experts) pairs per call; the overflow pairs are dropped (counted).
    capacity_factor: float | None = None
    # Width of one attention head; None = dim // n_heads (GPT-OSS: 64 with dim 2880 and 64 heads).
    attention_head_dim: int | None = None
    # RoPE scaling (`phalanx.models.rope`): "default" (none), "linear" (positions / factor), "llama3" (Llama 3.1:
    # low frequencies / factor, high ones kept, a smooth ramp between), "yarn" (NTK-by-parts + attention factor).
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_seq_len: int | None = None  # llama3 / yarn (required): the pretraining context
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_truncate: bool = True  # yarn: round the correction range to whole dimensions (GPT-OSS: False)
    rope_attention_factor: float | None = None  # yarn: cos/sin scale; None = 0.1 ln(factor) + 1
    # "llama": Llama / Mistral / Mixtral blocks. "gpt_oss": biases in attention, a learned attention sink per
    # head, and MoE with a biased router, softmax over the top-k logits and clamped-SwiGLU experts with biases.
    architecture: str = "llama"
    # Which layers use `sliding_window`: "all", or "even" (0, 2, 4, ...; the odd ones attend to everything).
    sliding_window_layers: str = "all"
    swiglu_alpha: float = 1.702  # gpt_oss experts: gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # gpt_oss experts: gate clamped above, up clamped to ±limit

    def __post_init__(self) -> None:
        if self.attention_head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads} "
                "(or set model.attention_head_dim)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.attention_head_dim={self.head_dim} must be even (rotary embeddings pair dims)")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"model.capacity_factor={self.capacity_factor} must be > 0 (or null for dropless routing)"
            )
        self._check_choice("architecture", ARCHITECTURES)
        self._check_choice("rope_type", ROPE_TYPES)
        self._check_choice("sliding_window_layers", SLIDING_WINDOW_LAYERS)
        if self.rope_factor <= 0 or (self.rope_type != "default" and self.rope_factor < 1):
            raise ValueError(f"model.rope_factor={self.rope_factor} must be >= 1 with rope_type={self.rope_type!r}")
        if self.rope_type in ("llama3", "yarn") and not (self.rope_original_max_seq_len or 0) > 0:
            raise ValueError(
                f"model.rope_original_max_seq_len={self.rope_original_max_seq_len} with rope_type="
                f"{self.rope_type!r}: set it to the context length the model was pretrained with (e.g. 8192)"
            )
        if self.rope_type == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"model.rope_low_freq_factor={self.rope_low_freq_factor} must be below "
                f"model.rope_high_freq_factor={self.rope_high_freq_factor} (rope_type 'llama3')"
            )
        if self.architecture == "gpt_oss" and not self.is_moe:
            raise ValueError("model.architecture='gpt_oss' needs experts: set model.n_experts > 0")

    def _check_choice(self, field: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, field)
        if value not in choices:
            raise ValueError(f"model.{field}={value!r} is not supported; choose one of {list(choices)}")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def has_attention_sinks(self) -> bool:
        return self.architecture == "gpt_oss"

    def layer_is_windowed(self, layer: int) -> bool:
        """Whether block `layer` attends within `sliding_window` (False: to every earlier position)."""
        if self.sliding_window is None:
            return False
        return self.sliding_window_layers == "all" or layer % 2 == 0

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count from the shapes alone (no model is built). `active`: MoE counts top_k experts."""
        h, i, v, d = self.dim, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.n_heads * d, self.n_kv_heads * d
        attn = h * (2 * q + 2 * kv)
        experts = self.top_k if active else self.n_experts
        if self.architecture == "gpt_oss":
            attn += q + 2 * kv + h + self.n_heads  # biases and sinks
            mlp = experts * (3 * h * i + 2 * i + h) + self.n_experts * (h + 1)  # experts with biases; router
        else:
            mlp = 3 * h * i * (experts if self.is_moe else 1) + (h * self.n_experts if self.is_moe else 0)
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embed + h

    def to_dict(self) -> dict:
        return asdict(self)

    def with_overrides(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    def differences(self, recorded: dict) -> dict[str, tuple]:
        """Fields whose value in `recorded` (another config's `to_dict()`, e.g. a checkpoint's) differs from
        ours and would change what the weights mean: {field: (recorded value, ours)}. Fields in
        `RESUMABLE_CHANGES` and fields `recorded` lacks (an older Phalanx) are not compared."""
        out = {}
        for f in fields(self):
            if f.name in RESUMABLE_CHANGES or f.name not in recorded:
                continue
            ours, theirs = getattr(self, f.name), recorded[f.name]
            if theirs != ours:
                out[f.name] = (theirs, ours)
        return out


PRESETS: dict[str, ModelConfig] = {
    # Small enough to train on CPU in seconds.
    "tiny": ModelConfig(
        vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=352,
        rope_theta=10000.0, max_seq_len=1024,
    ),
    "tiny-moe": ModelConfig(
        vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=256,
        rope_theta=10000.0, max_seq_len=1024, n_experts=8, top_k=2, router_aux_loss_coef=0.02,
    ),
    # ~125M: big enough that sharding matters in tests, small enough for CPU.
    "small": ModelConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, intermediate_size=2048,
        max_seq_len=2048,
    ),
    # ~1.2B Llama-style, for single-GPU throughput/MFU.
    "llama-1b": ModelConfig(
        vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192,
        rope_theta=500000.0, max_seq_len=4096,
    ),
    # Published shapes (Hugging Face config.json of each model).
    "llama2-7b": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096,
    ),
    "mistral-7b": ModelConfig(  # Mistral-7B-v0.1
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=32768, sliding_window=4096,
    ),
    "mathstral-7b": ModelConfig(  # Mathstral-7B-v0.1: 32k context, no sliding window
        vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
        norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=32768, sliding_window=None,
    ),
    "mixtral-8x7b": ModelConfig(  # Mixtral-8x7B-v0.1
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
        norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=32768, sliding_window=None,
        n_experts=8, top_k=2, router_aux_loss_coef=0.02,
    ),
    **{  # Llama 3.1 / 3.2 (base and Instruct share shapes): 128k context through llama3 RoPE scaling.
        name: ModelConfig(
            vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, rope_type="llama3",
            rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=8192, **shape,
        )
        for name, shape in {
            "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                                rope_factor=8.0),
            "llama3.1-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_size=28672,
                                 rope_factor=8.0),
            "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192,
                                rope_factor=32.0, tie_embeddings=True),
            "llama3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, intermediate_size=8192,
                                rope_factor=32.0, tie_embeddings=True),
        }.items()
    },
    **{  # openai/gpt-oss-*: 64 heads of 64 with 8 KV heads, 128-token windows on every other layer, YaRN ×32.
        name: ModelConfig(
            architecture="gpt_oss", vocab_size=201088, dim=2880, n_heads=64, n_kv_heads=8, attention_head_dim=64,
            intermediate_size=2880, norm_eps=1e-5, rope_theta=150000.0, max_seq_len=131072, rope_type="yarn",
            rope_factor=32.0, rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=False,
            rope_original_max_seq_len=4096, sliding_window=128, sliding_window_layers="even", top_k=4,
            router_aux_loss_coef=0.9, swiglu_alpha=1.702, swiglu_limit=7.0, **shape,
        )
        for name, shape in {
            "gpt-oss-20b": dict(n_layers=24, n_experts=32),
            "gpt-oss-120b": dict(n_layers=36, n_experts=128),
        }.items()
    },
    # GPT-OSS's architecture at CPU size: head width != dim / heads, windows of 16 on even layers, YaRN.
    "tiny-gpt-oss": ModelConfig(
        architecture="gpt_oss", vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
        attention_head_dim=48, intermediate_size=128, rope_theta=10000.0, max_seq_len=1024, rope_type="yarn",
        rope_factor=4.0, rope_original_max_seq_len=256, rope_truncate=False, sliding_window=16,
        sliding_window_layers="even", n_experts=8, top_k=2, router_aux_loss_coef=0.02,
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"model.preset={name!r} is not a known preset; choose one of {sorted(PRESETS)} "
            "or set model.hf_path to a Hugging Face model directory"
        ) from None
