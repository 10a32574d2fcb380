"""Llama 3.x: RoPE scaling (llama3, linear, yarn) and tied embeddings against transformers in both directions,
the published config.json files mapping onto the presets, and the presets' parameter counts.

Run with -s to see the measured logit differences.
"""

from __future__ import annotations

import math

import pytest
import torch

import transformers  # a test dependency (pyproject's `test` extra): missing, the file fails, never skips

from hf_compare import TOL, input_ids, max_diff, perturb, report  # noqa: E402
from phalanx.models import PRESETS, ModelConfig, build_model  # noqa: E402
from phalanx.models.hf import HFFormatError, config_from_hf, config_to_hf, load_hf_model, save_hf  # noqa: E402
from phalanx.models.llama import Transformer  # noqa: E402
from phalanx.models.rope import rope_inv_freq  # noqa: E402

VOCAB = 256
# head_dim 16 with theta 1e4: wavelengths 6.3 … 19869 positions, so a 64-token "original context" puts
# frequencies in all three llama3 bands (kept, smoothed, divided) and both ends of the yarn ramp.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# name -> extra LlamaConfig kwargs
HF_CASES = {
    "llama3.1-style": dict(rope_scaling=LLAMA3),
    "llama3.2-style-tied": dict(rope_scaling={**LLAMA3, "factor": 32.0}, tie_word_embeddings=True),
    "linear-legacy-key": dict(rope_scaling={"type": "linear", "factor": 4.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 128}),
    "yarn-untruncated-attention-factor": dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0,
        "truncate": False, "attention_factor": 1.3, "original_max_position_embeddings": 64}),
    "llama3-head-dim-24": dict(rope_scaling=LLAMA3, head_dim=24),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_checkpoint_loads_with_equal_logits(case, tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, **HF_CASES[case])
    hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    perturb(hf_model, seed=1)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_hf_model(tmp_path).eval()
    ids = input_ids(VOCAB, 40)
    with torch.no_grad():
        expected, got = hf_model(ids).logits, ours(ids)
    diff = max_diff(expected, got)
    report("llama3", f"HF {case} -> Phalanx", diff)
    assert diff <= TOL
    cfg = ours.config
    assert cfg.rope_type == hf_model.config.rope_parameters["rope_type"] != "default"
    assert (ours.lm_head is None) == ("tied" in case)
    # The scaling matters for this input: the same weights with plain RoPE give other logits.
    plain = Transformer(cfg.with_overrides(rope_type="default", rope_factor=1.0)).eval()
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert max_diff(plain(ids), got) > 1e-3


OUR_CASES = {
    "llama3": dict(rope_type="llama3", rope_factor=8.0, rope_original_max_seq_len=64, rope_low_freq_factor=1.0,
                   rope_high_freq_factor=4.0),
    "llama3-tied": dict(rope_type="llama3", rope_factor=32.0, rope_original_max_seq_len=64, tie_embeddings=True),
    "linear": dict(rope_type="linear", rope_factor=2.5),
    "yarn": dict(rope_type="yarn", rope_factor=4.0, rope_original_max_seq_len=128),
    "yarn-gpt-oss-style": dict(rope_type="yarn", rope_factor=32.0, rope_original_max_seq_len=16, rope_truncate=False,
                               rope_beta_fast=32.0, rope_beta_slow=1.0, attention_head_dim=24),
}


@pytest.mark.parametrize("case", list(OUR_CASES))
def test_saved_checkpoint_loads_in_transformers_with_equal_logits(case, tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                      rope_theta=10000.0, max_seq_len=512, **OUR_CASES[case])
    model = build_model(cfg, seed=3).eval()
    perturb(model, seed=4)
    save_hf(model, cfg, tmp_path / "ckpt")
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    assert hf_model.config.rope_parameters["rope_type"] == cfg.rope_type
    ids = input_ids(VOCAB, 40)
    with torch.no_grad():
        diff = max_diff(hf_model.eval()(ids).logits, model(ids))
    report("llama3", f"Phalanx {case} -> HF", diff)
    assert diff <= TOL
    assert load_hf_model(tmp_path / "ckpt").config == cfg


@pytest.mark.parametrize("case", list(OUR_CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(case):
    """The RoPE tables themselves, for the shapes above and for head_dim 128 (Llama 3's)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for head_dim in (16, 128):
        fields = {**OUR_CASES[case], "attention_head_dim": None}
        # yarn: transformers warns unless max positions = factor × original context
        max_seq_len = int(fields["rope_factor"] * fields.get("rope_original_max_seq_len", 8192))
        cfg = ModelConfig(dim=head_dim * 4, n_heads=4, n_kv_heads=4, rope_theta=500000.0, max_seq_len=max_seq_len,
                          **fields)
        hf = transformers.AutoConfig.for_model(**config_to_hf(cfg))
        expected, expected_factor = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf, "cpu")
        got, factor = rope_inv_freq(cfg)
        assert torch.equal(got, expected), (head_dim, (got - expected).abs().max())
        assert factor == pytest.approx(expected_factor, rel=1e-12)


# ---- published configs and presets -------------------------------------------------------------------------

_LLAMA3_COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                      attention_dropout=0.0, bos_token_id=128000, hidden_act="silu", initializer_range=0.02,
                      max_position_embeddings=131072, mlp_bias=False, num_key_value_heads=8, pretraining_tp=1,
                      rms_norm_eps=1e-05, rope_theta=500000.0, torch_dtype="bfloat16", use_cache=True,
                      vocab_size=128256)
_LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
                    rope_type="llama3")
# config.json of meta-llama/Llama-3.1-8B, -70B, Llama-3.2-1B, -3B as published (transformers 4.4x era).
PUBLISHED = {
    "llama3.1-8b": dict(_LLAMA3_COMMON, eos_token_id=128001, hidden_size=4096, intermediate_size=14336,
                        num_attention_heads=32, num_hidden_layers=32, rope_scaling=_LLAMA3_ROPE,
                        tie_word_embeddings=False),
    "llama3.1-70b": dict(_LLAMA3_COMMON, eos_token_id=128001, hidden_size=8192, intermediate_size=28672,
                         num_attention_heads=64, num_hidden_layers=80, rope_scaling=_LLAMA3_ROPE,
                         tie_word_embeddings=False),
    "llama3.2-1b": dict(_LLAMA3_COMMON, eos_token_id=128001, head_dim=64, hidden_size=2048, intermediate_size=8192,
                        num_attention_heads=32, num_hidden_layers=16, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
                        tie_word_embeddings=True),
    "llama3.2-3b": dict(_LLAMA3_COMMON, eos_token_id=128001, head_dim=128, hidden_size=3072,
                        intermediate_size=8192, num_attention_heads=24, num_hidden_layers=28,
                        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True),
}
# Parameter counts as published (safetensors metadata of the Hub repositories).
PUBLISHED_PARAMS = {"llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496, "llama3.2-1b": 1_235_814_400,
                    "llama3.2-3b": 3_212_749_824}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_published_config_json_equals_preset(preset):
    assert config_from_hf(PUBLISHED[preset]) == PRESETS[preset]


@pytest.mark.parametrize("preset", list(PUBLISHED_PARAMS))
def test_preset_parameter_count_equals_published(preset):
    cfg = PRESETS[preset]
    model = build_model(cfg, seed=None, device="meta")
    built = sum(p.numel() for p in model.parameters())
    assert built == cfg.num_params() == PUBLISHED_PARAMS[preset]
    assert (model.lm_head is None) == cfg.tie_embeddings == preset.startswith("llama3.2")
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (cfg.n_heads * cfg.head_dim, cfg.dim)


def test_llama3_frequencies_keep_high_divide_low_and_smooth_between():
    """Llama 3.1 8B's scaling, from its definition: wavelengths below 8192/4 kept, above 8192/1 divided by 8."""
    cfg = PRESETS["llama3.1-8b"]
    scaled, _ = rope_inv_freq(cfg)
    plain, _ = rope_inv_freq(cfg.with_overrides(rope_type="default"))
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert high.sum() > 0 and low.sum() > 0 and (~high & ~low).sum() > 0
    assert torch.equal(scaled[high], plain[high])
    assert torch.allclose(scaled[low], plain[low] / 8)
    ratio = scaled[~high & ~low] / plain[~high & ~low]
    assert ((ratio > 1 / 8) & (ratio < 1)).all()


@pytest.mark.parametrize(
    "rope, words",
    [
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, ["low_freq_factor", "llama3"]),
        ({"rope_type": "linear"}, ["factor", "linear"]),
        ({"rope_type": "dynamic", "factor": 2.0}, ["rope_type='dynamic'", "llama3", "yarn"]),
        ({"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
         ["rope_factor=0.5", ">= 1"]),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
         ["rope_low_freq_factor=4.0", "rope_high_freq_factor=1.0"]),
    ],
)
def test_bad_rope_scaling_is_refused_naming_the_field(rope, words):
    with pytest.raises(HFFormatError) as err:
        config_from_hf({"model_type": "llama", **COMMON, "rope_scaling": rope})
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_model_config_rope_errors_name_field_and_fix():
    with pytest.raises(ValueError, match=r"model\.rope_type='ntk'.*\['default', 'linear', 'llama3', 'yarn'\]"):
        ModelConfig(rope_type="ntk")
    with pytest.raises(ValueError, match=r"model\.rope_original_max_seq_len=None.*pretrained with"):
        ModelConfig(rope_type="yarn", rope_factor=4.0)
    # Context length stays resumable: the llama3/yarn math reads rope_original_max_seq_len, never max_seq_len.
    cfg = PRESETS["llama3.1-8b"]
    assert torch.equal(rope_inv_freq(cfg)[0], rope_inv_freq(cfg.with_overrides(max_seq_len=8192))[0])


def test_recipes_lay_out_for_2x8_and_8x8_gpus():
    from pathlib import Path

    from phalanx.train.config import load_config
    from phalanx.train.trainer import parallel_dims, resolve_model_config

    recipes = Path(__file__).parent.parent / "recipes"
    for name, world, layout, accum in (("llama3.1-8b", 16, (2, 8), 8), ("llama3.1-70b", 64, (1, 64), 4)):
        config = load_config(recipes / f"{name}.yaml")
        model = resolve_model_config(config)
        assert model == PRESETS[name]
        dims = parallel_dims(config, world, model)
        assert (dims.dp_replicate, dims.dp_shard) == layout
        assert config.grad_accum_steps(dims.dp_size) == accum


def test_yarn_mscale_pair_becomes_the_attention_factor_transformers_uses():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 0.7,
            "original_max_position_embeddings": 64}
    hf = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 1024}, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = config_from_hf({"model_type": "llama", **COMMON, "max_position_embeddings": 1024, "rope_parameters": rope})
    assert cfg.rope_attention_factor == pytest.approx(factor, rel=1e-12) and factor != pytest.approx(1.2773, rel=1e-3)
    assert torch.equal(rope_inv_freq(cfg)[0], inv_freq)
