"""Hugging Face `config.json` <-> `ModelConfig`: the config mapping for Llama, Mistral and Mixtral, with
transformers' defaults for the keys a file may leave out, and refusals (`HFFormatError`) that name the key
for what Phalanx cannot build exactly.

Knows nothing about weights or safetensors (`phalanx.models.hf` reads and writes those), torch.distributed,
training or the CLI; needs neither `safetensors` nor `transformers`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from phalanx.models.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
# transformers' defaults for keys a config.json may leave out (they differ between model types).
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "mistral": 10000.0, "mixtral": 1000000.0}
_DEFAULT_NORM_EPS = {"llama": 1e-6, "mistral": 1e-6, "mixtral": 1e-5}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "mixtral": 4096 * 32}
_DEFAULT_SLIDING_WINDOW = {"llama": None, "mistral": 4096, "mixtral": None}


class HFFormatError(ValueError):
    """A Hugging Face config or checkpoint that Phalanx cannot read or write exactly."""


# ---- config.json ----------------------------------------------------------------------------------------


def config_from_hf(hf_config: dict) -> ModelConfig:
    """`ModelConfig` from a parsed HF `config.json` (llama / mistral / mixtral). Raises `HFFormatError`."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFormatError(
            f"config.json model_type={model_type!r} is not supported; Phalanx reads {list(SUPPORTED_MODEL_TYPES)} "
            "(Llama-family decoders). Convert the model or pick a supported checkpoint."
        )

    def get(key, default):
        value = hf_config.get(key)
        return default if value is None else value

    def required(key):
        if hf_config.get(key) is None:
            raise HFFormatError(f"config.json has no {key!r}; a {model_type} config needs it")
        return hf_config[key]

    for key, fix in (("attention_bias", "attention projections"), ("mlp_bias", "MLP projections")):
        if hf_config.get(key):
            raise HFFormatError(f"config.json {key}={hf_config[key]!r}: Phalanx models have no bias in {fix}")
    if get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"config.json hidden_act={hf_config['hidden_act']!r}: only 'silu' (SwiGLU) is supported")

    dim, n_heads = required("hidden_size"), required("num_attention_heads")
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and head_dim * n_heads != dim:
        raise HFFormatError(
            f"config.json head_dim={head_dim} != hidden_size/num_attention_heads = {dim}/{n_heads}: "
            "Phalanx derives head_dim from hidden_size; such checkpoints are not supported"
        )

    # transformers 5 keeps RoPE under rope_parameters; older files use rope_scaling (which wins if both are set).
    ropes = {key: hf_config[key] for key in ("rope_scaling", "rope_parameters") if hf_config.get(key)}
    for key, rope in ropes.items():
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise HFFormatError(
                f"config.json {key}.rope_type={rope_type!r}: only 'default' RoPE is supported "
                "(no linear/dynamic/yarn/llama3 scaling)"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise HFFormatError(f"config.json {key}.partial_rotary_factor={rope['partial_rotary_factor']}: need 1.0")
    thetas = [rope["rope_theta"] for rope in ropes.values() if rope.get("rope_theta")]
    rope_theta = (thetas or [hf_config.get("rope_theta") or _DEFAULT_ROPE_THETA[model_type]])[0]

    # HF's Llama has no sliding window whatever the file says; Mistral's default (key absent) is 4096.
    if model_type == "llama":
        sliding_window = None
    else:
        sliding_window = hf_config.get("sliding_window", _DEFAULT_SLIDING_WINDOW[model_type])
    fields = dict(
        vocab_size=required("vocab_size"),
        dim=dim,
        n_layers=required("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", n_heads),
        intermediate_size=required("intermediate_size"),
        norm_eps=float(get("rms_norm_eps", _DEFAULT_NORM_EPS[model_type])),
        rope_theta=float(rope_theta),
        max_seq_len=get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type]),
        sliding_window=sliding_window,
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        init_std=float(get("initializer_range", 0.02)),
    )
    if model_type == "mixtral":
        fields.update(
            n_experts=get("num_local_experts", get("num_experts", 8)),
            top_k=get("num_experts_per_tok", 2),
            router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)),
        )
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise HFFormatError(f"config.json describes a model Phalanx cannot build: {e}") from None


def _architecture_for(cfg: ModelConfig, architecture: str | None) -> str:
    if architecture is None:
        return "mixtral" if cfg.is_moe else "mistral" if cfg.sliding_window is not None else "llama"
    by_name = {v: k for k, v in _ARCHITECTURES.items()}
    model_type = by_name.get(architecture, architecture)
    if model_type not in _ARCHITECTURES:
        raise HFFormatError(f"architecture={architecture!r} is not one of {sorted(by_name)}")
    if cfg.is_moe != (model_type == "mixtral"):
        raise HFFormatError(
            f"architecture={architecture!r} does not fit model.n_experts={cfg.n_experts}: "
            "use MixtralForCausalLM exactly when the model has experts (or leave architecture=None)"
        )
    if model_type == "llama" and cfg.sliding_window is not None:
        raise HFFormatError(
            f"architecture={architecture!r} cannot express model.sliding_window={cfg.sliding_window}: "
            "use MistralForCausalLM (or leave architecture=None)"
        )
    return model_type


def config_to_hf(cfg: ModelConfig, architecture: str | None = None, *, dtype: torch.dtype = torch.float32) -> dict:
    """HF `config.json` dict for `cfg`. architecture=None: Mixtral if MoE, Mistral if windowed, else Llama."""
    model_type = _architecture_for(cfg, architecture)
    dtype_name = str(dtype).removeprefix("torch.")
    out = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # transformers < 5 reads this key; 5 prefers rope_parameters
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "attention_dropout": 0.0, "use_cache": True, "dtype": dtype_name,
        "torch_dtype": dtype_name,  # transformers < 5
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out["sliding_window"] = cfg.sliding_window  # explicit null: Mistral's default is 4096
    if model_type == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0,
                   router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    return out


# ---- reading --------------------------------------------------------------------------------------------


def read_hf_config_json(path: str | os.PathLike) -> dict:
    """The parsed `config.json` of the HF model directory `path`. Raises `HFFormatError` saying what is wrong
    (no such directory, a file, no config.json, not valid JSON, not a JSON object)."""
    path = Path(path)
    if not path.is_dir():
        what = "it is a file" if path.exists() else "it does not exist"
        raise HFFormatError(f"HF checkpoint path {str(path)!r} is not a directory ({what}); point it at a local "
                            "Hugging Face model directory (config.json + *.safetensors)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HFFormatError(f"{str(path)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        hf_config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFFormatError(f"{config_file} is not valid JSON ({err}); restore the model's config.json") from None
    if not isinstance(hf_config, dict):
        raise HFFormatError(f"{config_file} must hold a JSON object, found {type(hf_config).__name__}")
    return hf_config


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """`ModelConfig` of the HF model directory `path` from its config.json alone (no weights are opened)."""
    return config_from_hf(read_hf_config_json(path))
