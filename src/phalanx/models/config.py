"""Model shapes: one dataclass and the named presets.

A `ModelConfig` is everything needed to build a Llama-family decoder (dense or Mixtral-style MoE).
Field names follow our code; `phalanx.models.hf` maps them to and from Hugging Face `config.json`.
Knows nothing about parallelism, data or training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

# Fields a run may change when it resumes from a checkpoint of the same model: they do not change what the
# weights mean (the context length the model accepts, the init used before any step, MoE loss/capacity knobs).
RESUMABLE_CHANGES = frozenset({"max_seq_len", "init_std", "router_aux_loss_coef", "capacity_factor"})


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

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"model.capacity_factor={self.capacity_factor} must be > 0 (or null for dropless routing)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count from the shapes alone (no model is built). `active`: MoE counts top_k experts."""
        h, i, v = self.dim, self.intermediate_size, self.vocab_size
        attn = h * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        experts = self.top_k if active else self.n_experts
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
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"model.preset={name!r} is not a known preset; choose one of {sorted(PRESETS)} "
            "or set model.hf_path to a Hugging Face model directory"
        ) from None
