"""GPT-OSS: logits equal transformers' in both directions, the published MXFP4 checkpoint layout loads (the
dequantized weights equal transformers' own dequantization), the published config.json files map onto the
presets with the published parameter counts, and the pieces (attention sinks, routing) equal their definitions.

Run with -s to see the measured logit differences.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import transformers  # a test dependency (pyproject's `test` extra): missing, the file fails, never skips

from hf_compare import TOL, input_ids, max_diff, perturb, report  # noqa: E402
from phalanx.models import PRESETS, ModelConfig, build_model  # noqa: E402
from phalanx.models.gpt_oss import GptOssMoE, attention_with_sinks  # noqa: E402
from phalanx.models.hf import HFCheckpoint, HFFormatError, config_from_hf, load_hf_model, save_hf  # noqa: E402
from phalanx.models.llama import Transformer  # noqa: E402
from phalanx.models.mxfp4 import dequantize_mxfp4  # noqa: E402

VOCAB = 256
# Small, but every GPT-OSS feature is live on a 40-token input: head_dim (24) != hidden / heads, windows of 8 on
# even layers, YaRN, 4 experts top-2, and swiglu_limit 0.3 so that the clamps cut (init values are ~0.05).
HF_KWARGS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    swiglu_limit=0.3, max_position_embeddings=512,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 64},
)
SMALL = ModelConfig(
    architecture="gpt_oss", vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attention_head_dim=24,
    intermediate_size=32, n_experts=4, top_k=2, sliding_window=8, sliding_window_layers="even", swiglu_limit=0.3,
    rope_type="yarn", rope_factor=8.0, rope_original_max_seq_len=64, rope_truncate=False, max_seq_len=512,
)


def _hf_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**HF_KWARGS)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    perturb(model, seed=seed + 1)
    return model


def _logits_with(model: Transformer, **overrides) -> torch.Tensor:
    other = Transformer(model.config.with_overrides(**overrides)).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        return other(input_ids(VOCAB, 40))


# ---- transformers <-> Phalanx -----------------------------------------------------------------------------


def test_transformers_checkpoint_loads_with_equal_logits(tmp_path):
    hf_model = _hf_model()
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_hf_model(tmp_path).eval()
    assert ours.config == SMALL.with_overrides(router_aux_loss_coef=0.001)  # transformers' default coefficient
    ids = input_ids(VOCAB, 40)
    with torch.no_grad():
        expected, got = hf_model(ids).logits, ours(ids)
    diff = max_diff(expected, got)
    report("gpt-oss", "HF GPT-OSS -> Phalanx", diff)
    assert diff <= TOL
    # Each GPT-OSS feature changes the logits of this input, so the comparison above covers it.
    assert max_diff(_logits_with(ours, sliding_window=None), got) > 1e-3
    assert max_diff(_logits_with(ours, sliding_window_layers="all"), got) > 1e-3
    assert max_diff(_logits_with(ours, swiglu_limit=100.0), got) > 1e-3
    assert max_diff(_logits_with(ours, rope_type="default"), got) > 1e-3
    no_sinks = Transformer(ours.config).eval()
    no_sinks.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no probability mass
        assert max_diff(no_sinks(ids), got) > 1e-3


def test_saved_checkpoint_loads_in_transformers_with_equal_logits(tmp_path):
    model = build_model(SMALL, seed=3).eval()
    perturb(model, seed=4)
    save_hf(model, SMALL, tmp_path / "ckpt", max_shard_size_bytes=60_000)
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", attn_implementation="eager", experts_implementation="eager", dtype=torch.float32,
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(hf_model).__name__ == "GptOssForCausalLM"
    assert hf_model.config.layer_types == ["sliding_attention", "full_attention"]
    ids = input_ids(VOCAB, 40)
    with torch.no_grad():
        diff = max_diff(hf_model.eval()(ids).logits, model(ids))
    report("gpt-oss", "Phalanx GPT-OSS -> HF", diff)
    assert diff <= TOL
    reloaded = load_hf_model(tmp_path / "ckpt")
    assert reloaded.config == SMALL
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


# ---- MXFP4 -------------------------------------------------------------------------------------------------

_FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., rows, cols] → (blocks uint8 [..., rows, cols/32, 16], scales uint8 [..., rows, cols/32]), as the
    OCP MX spec lays it out: per 32 values a power-of-two scale 2^(s - 127) with the block's largest magnitude
    ≤ 6 after scaling, each value rounded to the nearest E2M1 magnitude (sign in bit 3), two per byte, low first."""
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100) / 6.0))
    scaled = groups / torch.exp2(exponent)
    magnitude = (scaled.abs().unsqueeze(-1) - _FP4_MAGNITUDES).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)


def _e2m1(code: int) -> float:
    """An FP4 E2M1 code's value from the bit layout (sign | 2-bit exponent, bias 1 | 1-bit mantissa)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def test_dequantize_equals_the_spec_and_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 5, 2), dtype=torch.uint8, generator=gen)
    ours = dequantize_mxfp4(blocks, scales)  # [3, 5, 64]
    spec = torch.tensor([
        [[_e2m1((int(blocks[e, r, j // 32, (j % 32) // 2]) >> (4 * (j % 2))) & 0xF)
          * 2.0 ** (int(scales[e, r, j // 32]) - 127) for j in range(64)] for r in range(5)] for e in range(3)
    ])
    assert torch.equal(ours, spec)
    # transformers returns the in-memory layout [E, cols, rows]: the transpose of ours.
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), ours.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact in bf16 too
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales)


def _write_mxfp4_checkpoint(hf_model, path) -> dict[str, torch.Tensor]:
    """The published layout: expert weights as *_blocks / *_scales, output-major; everything else bf16-free fp32
    as is; quantization_config in config.json. Returns the dequantized expert weights (transformers' layout)."""
    hf_model.save_pretrained(path, safe_serialization=True)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    dequantized = {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state.pop(key).transpose(1, 2))
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        dequantized[key] = dequantize_mxfp4(blocks, scales).transpose(1, 2)
    (path / "model.safetensors").unlink()
    save_file(state, str(path / "model.safetensors"), {"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


def test_mxfp4_checkpoint_loads_dequantized_like_transformers(tmp_path):
    hf_model = _hf_model(seed=5)
    dequantized = _write_mxfp4_checkpoint(hf_model, tmp_path)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    with HFCheckpoint(tmp_path) as ckpt:
        assert torch.equal(ckpt.read(key), dequantized[key])
        assert torch.equal(ckpt.read_rows(key, 1, 3), dequantized[key][1:3])  # an expert-parallel rank's experts
        assert torch.equal(ckpt.read(key, torch.bfloat16).float(), dequantized[key])
        # quantization really happened: the weights moved onto the FP4 grid
        assert 1e-4 < max_diff(dequantized[key], hf_model.state_dict()[key])
    ours = load_hf_model(tmp_path).eval()

    reference, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), attn_implementation="eager",
        experts_implementation="eager", dtype=torch.float32, output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, value in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name
    with torch.no_grad():
        diff = max_diff(reference.eval()(input_ids(VOCAB, 40)).logits, ours(input_ids(VOCAB, 40)))
    report("gpt-oss", "HF MXFP4 checkpoint (transformers dequantize=True) -> Phalanx", diff)
    assert diff <= TOL

    save_hf(ours, ours.config, tmp_path / "back", dtype=torch.bfloat16)  # saved back unquantized
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in back and back["dtype"] == "bfloat16"
    with HFCheckpoint(tmp_path / "back") as ckpt:
        assert torch.equal(ckpt.read(key), dequantized[key])  # MXFP4 values are exact in bf16


def test_mxfp4_errors_name_the_tensor_and_the_fix(tmp_path):
    hf_model = _hf_model(seed=6)
    _write_mxfp4_checkpoint(hf_model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(HFFormatError, match=r"gate_up_proj_(blocks|scales).*\[4, (64|96), 2"):
        HFCheckpoint(tmp_path)
    config["quantization_config"]["quant_method"] = "fp8"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFFormatError, match=r"quant_method='fp8'.*dequantize the checkpoint first"):
        HFCheckpoint(tmp_path)


# ---- published configs and presets -------------------------------------------------------------------------


def _published(n_layers: int, n_experts: int) -> dict:
    """config.json of openai/gpt-oss-20b / -120b as published (transformers 4.55 era)."""
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (n_layers // 2), "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": n_layers,
        "num_key_value_heads": 8, "num_local_experts": n_experts, "output_router_logits": False,
        "pad_token_id": 199999, "rms_norm_eps": 1e-05,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
    }


# OpenAI's model card: total parameters and active parameters per token (all but the embedding table).
PUBLISHED = {"gpt-oss-20b": (_published(24, 32), 20.91e9, 3.61e9),
             "gpt-oss-120b": (_published(36, 128), 116.83e9, 5.13e9)}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_published_config_json_equals_preset_with_published_sizes(preset):
    hf_config, total, active = PUBLISHED[preset]
    cfg = PRESETS[preset]
    assert config_from_hf(hf_config) == cfg
    model = build_model(cfg, seed=None, device="meta")
    built = sum(p.numel() for p in model.parameters())
    assert built == cfg.num_params()
    assert round(built / 1e9, 2) == round(total / 1e9, 2)
    embedding = cfg.vocab_size * cfg.dim
    assert round((cfg.num_params(active=True) - embedding) / 1e9, 2) == round(active / 1e9, 2)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (cfg.n_experts, 2880, 2 * 2880)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64 * 64, 2880)
    assert [cfg.layer_is_windowed(i) for i in range(4)] == [True, False, True, False]


def test_gpt_oss_config_errors():
    base = {"model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 32}
    assert config_from_hf(base).rope_type == "yarn"  # transformers' GPT-OSS defaults
    with pytest.raises(HFFormatError, match=r"layer_types=.*all layers or on the even ones"):
        config_from_hf({**base, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(HFFormatError, match="attention_bias=false"):
        config_from_hf({**base, "attention_bias": False})
    with pytest.raises(ValueError, match=r"architecture='gpt_oss' needs experts.*n_experts"):
        ModelConfig(architecture="gpt_oss")


# ---- the pieces against their definitions ------------------------------------------------------------------


def test_attention_with_sinks_equals_explicit_softmax_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    b, h, t, d, window = 2, 3, 12, 16, 5
    q, k, v = (torch.randn(b, h, t, d, generator=gen, requires_grad=True) for _ in range(3))
    sinks = torch.randn(h, generator=gen, requires_grad=True)
    i = torch.arange(t)
    allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~allowed, float("-inf"))
    with_sink = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, t, 1)], dim=-1)
    expected = F.softmax(with_sink, dim=-1)[..., :-1] @ v
    got = attention_with_sinks(q, k, v, sinks, F.pad(allowed, (1, 0), value=True))
    assert max_diff(got, expected) <= 1e-6
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, sinks))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v, sinks))
    for a, e in zip(grads, expected_grads):
        assert max_diff(a, e) <= 1e-5
    assert sinks.grad is None and grads[3].abs().min() > 0


def test_routing_softmaxes_the_top_k_biased_logits():
    moe = GptOssMoE(PRESETS["tiny-gpt-oss"])
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(10, moe.router.weight.shape[1])
    probs, top_w, top_idx = moe.route(x)
    logits = x @ moe.router.weight.T + moe.router.bias
    assert torch.equal(top_idx, logits.topk(2, dim=-1).indices)
    assert torch.allclose(top_w, F.softmax(logits.gather(1, top_idx), dim=-1))
    assert torch.allclose(probs, F.softmax(logits, dim=-1))
    without_bias = torch.topk(x @ moe.router.weight.T, 2, dim=-1).indices
    assert not torch.equal(without_bias, top_idx)  # the bias moves the routing at this scale


# ---- end to end ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_continual_pretraining_from_the_mxfp4_layout_with_ep2_then_export(tmp_path, demo_data):
    """hf_path at a checkpoint in the published layout (MXFP4 experts): 2 ranks with ep 2 each dequantize only their
    experts; step 1's loss equals transformers' (dequantize=True) on the same batch; `phalanx export-hf` writes a
    checkpoint transformers loads, with logits equal to ours."""
    from typer.testing import CliRunner

    from conftest import run_training, tiny_config
    from phalanx.cli import app
    from phalanx.data import GlobalBatchSampler, TokenDataset

    torch.manual_seed(0)
    kwargs = {**HF_KWARGS, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64}
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.GptOssConfig(**kwargs), attn_implementation="eager", experts_implementation="eager").eval()
    perturb(hf_model, seed=9)
    _write_mxfp4_checkpoint(hf_model, tmp_path / "published")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "published", quantization_config=transformers.Mxfp4Config(dequantize=True),
        attn_implementation="eager", experts_implementation="eager", dtype=torch.float32).eval()

    cfg = tiny_config(tmp_path / "cpt", demo_data, training={"max_steps": 2}, parallel={"expert_parallel_degree": 2},
                      model={"preset": None, "hf_path": str(tmp_path / "published"),
                             "overrides": {"router_aux_loss_coef": 0.0}})
    steps = run_training(cfg, nproc=2)
    dataset = TokenDataset(demo_data)
    batch = dataset.get_batch(GlobalBatchSampler(len(dataset), 8, seed=cfg.seed, dp_rank=0, dp_size=1).global_batch(0))
    with torch.no_grad():
        expected = reference(batch, labels=batch).loss.item()
    print(f"\n[gpt-oss] MXFP4 checkpoint, 2 ranks ep 2: |step-1 loss - transformers' loss| = "
          f"{abs(steps[0]['loss'] - expected):.2e}")
    assert abs(steps[0]["loss"] - expected) <= 1e-5, (steps[0]["loss"], expected)

    result = CliRunner().invoke(app, ["export-hf", str(tmp_path / "cpt"), str(tmp_path / "exported")])
    assert result.exit_code == 0, result.output
    assert "quantization_config" not in json.loads((tmp_path / "exported" / "config.json").read_text())
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "exported", attn_implementation="eager", experts_implementation="eager", dtype=torch.float32,
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_hf_model(tmp_path / "exported").eval()
    with torch.no_grad():
        diff = max_diff(exported.eval()(batch).logits, ours(batch))
        report("gpt-oss", "exported after training -> HF", diff)
        assert diff <= TOL
        assert exported(batch, labels=batch).loss.item() < expected  # two steps of training moved the weights
