"""Hugging Face `config.json` <-> `ModelConfig`: the config mapping for Llama (2, 3.x), Mistral, Mixtral and
GPT-OSS, RoPE scaling included, with transformers' defaults for the keys a file may leave out, and refusals
(`HFFormatError`) that name the key for what Phalanx cannot build exactly.

Knows nothing about weights or safetensors (`phalanx.models.hf` reads and writes those), torch.distributed,
training or the CLI; needs neither `safetensors` nor `transformers`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from phalanx.models.config import ROPE_TYPES, ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "gpt_oss")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}
# transformers' defaults for keys a config.json may leave out (they differ between model types).
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "mistral": 10000.0, "mixtral": 1000000.0, "gpt_oss": 150000.0}
_DEFAULT_NORM_EPS = {"llama": 1e-6, "mistral": 1e-6, "mixtral": 1e-5, "gpt_oss": 1e-5}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "mixtral": 4096 * 32, "gpt_oss": 131072}
_DEFAULT_SLIDING_WINDOW = {"llama": None, "mistral": 4096, "mixtral": None, "gpt_oss": 128}
_GPT_OSS_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}
# Quantized checkpoints Phalanx reads (dequantizing on load): {model_type: quant_method}.
_READABLE_QUANTIZATION = {"gpt_oss": "mxfp4"}


class HFFormatError(ValueError):
    """A Hugging Face config or checkpoint that Phalanx cannot read or write exactly."""


# ---- config.json ----------------------------------------------------------------------------------------


def _rope_fields(hf_config: dict, model_type: str, max_positions: int) -> dict:
    """Our rope_* fields from config.json's rope_scaling / rope_parameters (and top-level rope_theta)."""
    # transformers 5 keeps RoPE under rope_parameters; older files use rope_scaling (which wins if both are set).
    ropes = {key: hf_config[key] for key in ("rope_scaling", "rope_parameters") if hf_config.get(key)}
    if not ropes and model_type == "gpt_oss":
        ropes = {"rope_parameters": _GPT_OSS_DEFAULT_ROPE}
    thetas = [rope["rope_theta"] for rope in ropes.values() if rope.get("rope_theta")]
    out = {"rope_theta": float((thetas or [hf_config.get("rope_theta") or _DEFAULT_ROPE_THETA[model_type]])[0])}
    if not ropes:
        return out
    key, rope = next(iter(ropes.items()))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise HFFormatError(
            f"config.json {key}.rope_type={rope_type!r} is not supported; Phalanx builds {list(ROPE_TYPES)} RoPE"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFFormatError(f"config.json {key}.partial_rotary_factor={rope['partial_rotary_factor']}: need 1.0")
    out["rope_type"] = rope_type
    if rope_type == "default":
        return out

    def need(name):
        if rope.get(name) is None:
            raise HFFormatError(f"config.json {key} has no {name!r}; rope_type {rope_type!r} needs it")
        return rope[name]

    original = rope.get("original_max_position_embeddings") or max_positions  # transformers' default
    if rope_type == "yarn" and rope.get("factor") is None:
        out["rope_factor"] = float(max_positions / original)  # transformers' default
    else:
        out["rope_factor"] = float(need("factor"))
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(need("low_freq_factor")),
                   rope_high_freq_factor=float(need("high_freq_factor")), rope_original_max_seq_len=int(original))
    elif rope_type == "yarn":
        attention_factor = rope.get("attention_factor")
        if attention_factor is None and rope.get("mscale") and rope.get("mscale_all_dim"):
            def mscale(m):
                return 0.1 * m * math.log(out["rope_factor"]) + 1.0 if out["rope_factor"] > 1 else 1.0

            attention_factor = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"])
        out.update(rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                   rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                   rope_truncate=bool(rope.get("truncate", True)), rope_original_max_seq_len=int(original),
                   rope_attention_factor=None if attention_factor is None else float(attention_factor))
    return out


def _check_quantization(hf_config: dict, model_type: str) -> None:
    quant = hf_config.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method != _READABLE_QUANTIZATION.get(model_type):
        raise HFFormatError(
            f"config.json quantization_config.quant_method={method!r} is not supported for model_type {model_type!r}; "
            "Phalanx trains from unquantized weights (or GPT-OSS's MXFP4 experts, dequantized on load): "
            "dequantize the checkpoint first (e.g. load it with transformers and save_pretrained the result)"
        )


def _sliding_window_layers(hf_config: dict, model_type: str, n_layers: int) -> str | None:
    """Which layers are windowed: "all", "even", or None (GPT-OSS with every layer full_attention)."""
    if model_type != "gpt_oss":
        return "all"
    even = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    types = hf_config.get("layer_types") or even  # transformers' GptOssConfig default
    if list(types) == even:
        return "even"
    if list(types) == ["sliding_attention"] * n_layers:
        return "all"
    if list(types) == ["full_attention"] * n_layers:
        return None
    raise HFFormatError(
        f"config.json layer_types={types!r}: Phalanx builds windows on all layers or on the even ones "
        "(sliding_attention, full_attention, ... as GPT-OSS), not this pattern"
    )


def config_from_hf(hf_config: dict) -> ModelConfig:
    """`ModelConfig` from a parsed HF `config.json` (llama / mistral / mixtral / gpt_oss). Raises `HFFormatError`."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFormatError(
            f"config.json model_type={model_type!r} is not supported; Phalanx reads {list(SUPPORTED_MODEL_TYPES)} "
            "(Llama-family decoders and GPT-OSS). Convert the model or pick a supported checkpoint."
        )
    gpt_oss = model_type == "gpt_oss"

    def get(key, default):
        value = hf_config.get(key)
        return default if value is None else value

    def required(key):
        if hf_config.get(key) is None:
            raise HFFormatError(f"config.json has no {key!r}; a {model_type} config needs it")
        return hf_config[key]

    _check_quantization(hf_config, model_type)
    if gpt_oss:
        if not get("attention_bias", True):
            raise HFFormatError("config.json attention_bias=false: Phalanx's GPT-OSS has biases in attention")
    else:
        for key, fix in (("attention_bias", "attention projections"), ("mlp_bias", "MLP projections")):
            if hf_config.get(key):
                raise HFFormatError(f"config.json {key}={hf_config[key]!r}: Phalanx models have no bias in {fix}")
        if get("hidden_act", "silu") != "silu":
            raise HFFormatError(
                f"config.json hidden_act={hf_config['hidden_act']!r}: only 'silu' (SwiGLU) is supported"
            )

    dim, n_heads = required("hidden_size"), required("num_attention_heads")
    head_dim = hf_config.get("head_dim")
    if head_dim is None and gpt_oss:
        head_dim = 64  # transformers' GptOssConfig default
    max_positions = get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type])
    # HF's Llama has no sliding window whatever the file says; Mistral's default (key absent) is 4096.
    if model_type == "llama":
        sliding_window = None
    else:
        sliding_window = hf_config.get("sliding_window", _DEFAULT_SLIDING_WINDOW[model_type])
    n_layers = required("num_hidden_layers")
    windowed_layers = _sliding_window_layers(hf_config, model_type, n_layers)
    if windowed_layers is None:
        sliding_window, windowed_layers = None, "all"
    fields = dict(
        vocab_size=get("vocab_size", 201088) if gpt_oss else required("vocab_size"),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", n_heads),
        intermediate_size=required("intermediate_size"),
        norm_eps=float(get("rms_norm_eps", _DEFAULT_NORM_EPS[model_type])),
        max_seq_len=max_positions,
        sliding_window=sliding_window,
        sliding_window_layers=windowed_layers,
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        init_std=float(get("initializer_range", 0.02)),
        attention_head_dim=None if head_dim is None or head_dim * n_heads == dim else head_dim,
        **_rope_fields(hf_config, model_type, max_positions),
    )
    if model_type == "mixtral":
        fields.update(
            n_experts=get("num_local_experts", get("num_experts", 8)),
            top_k=get("num_experts_per_tok", 2),
            router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)),
        )
    if gpt_oss:
        fields.update(
            architecture="gpt_oss",
            n_experts=get("num_local_experts", get("num_experts", 128)),
            top_k=get("num_experts_per_tok", get("experts_per_token", 4)),
            router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)),
            swiglu_alpha=float(get("swiglu_alpha", 1.702)),
            swiglu_limit=float(get("swiglu_limit", 7.0)),
        )
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise HFFormatError(f"config.json describes a model Phalanx cannot build: {e}") from None


def _architecture_for(cfg: ModelConfig, architecture: str | None) -> str:
    if architecture is None:
        if cfg.architecture == "gpt_oss":
            return "gpt_oss"
        return "mixtral" if cfg.is_moe else "mistral" if cfg.sliding_window is not None else "llama"
    by_name = {v: k for k, v in _ARCHITECTURES.items()}
    model_type = by_name.get(architecture, architecture)
    if model_type not in _ARCHITECTURES:
        raise HFFormatError(f"architecture={architecture!r} is not one of {sorted(by_name)}")
    if (model_type == "gpt_oss") != (cfg.architecture == "gpt_oss"):
        raise HFFormatError(
            f"architecture={architecture!r} does not fit model.architecture={cfg.architecture!r}: "
            "use GptOssForCausalLM exactly for GPT-OSS models (or leave architecture=None)"
        )
    if model_type != "gpt_oss" and cfg.is_moe != (model_type == "mixtral"):
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


def _rope_to_hf(cfg: ModelConfig) -> dict:
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_seq_len)
    if cfg.rope_type == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate,
                    original_max_position_embeddings=cfg.rope_original_max_seq_len)
        if cfg.rope_attention_factor is not None:
            rope["attention_factor"] = cfg.rope_attention_factor
    return rope


def config_to_hf(cfg: ModelConfig, architecture: str | None = None, *, dtype: torch.dtype = torch.float32) -> dict:
    """HF `config.json` dict for `cfg`. architecture=None: GPT-OSS for a gpt_oss model, else Mixtral if MoE,
    Mistral if windowed, else Llama."""
    model_type = _architecture_for(cfg, architecture)
    if cfg.sliding_window_layers != "all" and model_type != "gpt_oss" and cfg.sliding_window is not None:
        raise HFFormatError(
            f"model.sliding_window_layers={cfg.sliding_window_layers!r}: only GPT-OSS checkpoints express windows "
            "on some layers; use 'all' for a Mistral-style model"
        )
    dtype_name = str(dtype).removeprefix("torch.")
    rope = _rope_to_hf(cfg)
    out = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,  # transformers < 5 reads this key; 5 prefers rope_parameters
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "attention_dropout": 0.0, "use_cache": True, "dtype": dtype_name,
        "torch_dtype": dtype_name,  # transformers < 5
    }
    if cfg.rope_type != "default":
        out["rope_scaling"] = dict(rope)  # transformers < 5 reads scaling here
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out["sliding_window"] = cfg.sliding_window  # explicit null: Mistral's default is 4096
    if model_type == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0,
                   router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    if model_type == "gpt_oss":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, attention_bias=True,
                   router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False,
                   swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
                   layer_types=["sliding_attention" if cfg.layer_is_windowed(i) else "full_attention"
                                for i in range(cfg.n_layers)])
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
