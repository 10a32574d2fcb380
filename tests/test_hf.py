"""Hugging Face interop (phalanx.models.hf): logits equal transformers' in both directions, row reads
equal slices of the full tensor, config.json maps both ways, and bad inputs fail with clear errors.

Run with -s to see the measured logit differences.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import transformers  # a test dependency (pyproject's `test` extra): missing, the file fails, never skips

from hf_compare import TOL, input_ids, perturb, report  # noqa: E402
from phalanx.models import PRESETS, ModelConfig, build_model  # noqa: E402
from phalanx.models.hf import (  # noqa: E402
    HFCheckpoint,
    HFFormatError,
    config_from_hf,
    config_to_hf,
    load_hf_model,
    save_hf,
)
from phalanx.models.llama import Transformer  # noqa: E402

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)
# name -> (config class, extra config kwargs, save_pretrained max_shard_size or None)
HF_CASES = {
    "mistral-gqa-window8-sharded": ("MistralConfig", dict(sliding_window=8, rope_theta=500.0), "20KB"),
    "mixtral-4experts-top2": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), None),
    "llama-mha": ("LlamaConfig", dict(num_key_value_heads=4, rms_norm_eps=1e-5), None),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True), None),
}


@functools.cache
def _hf_checkpoint(case: str, root: str):
    """A random eval-mode transformers model and the directory it was save_pretrained to."""
    config_cls, extra, shard = HF_CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra}, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    perturb(model, seed=1)
    path = os.path.join(root, case)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model, path


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf"))


# ---- transformers -> Phalanx ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_checkpoint_loads_with_equal_logits(case, hf_root):
    hf_model, path = _hf_checkpoint(case, hf_root)
    ours = load_hf_model(path).eval()
    ids = input_ids(VOCAB, 24)
    with torch.no_grad():
        expected, got = hf_model(ids).logits, ours(ids)
    diff = (expected - got).abs().max().item()
    report("hf", f"HF {case} -> Phalanx", diff)
    assert diff <= TOL

    if case.startswith("mistral"):
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
        assert ours.config.sliding_window == 8 and ours.config.rope_theta == 500.0
        # The window matters for this input: plain causal attention gives different logits.
        causal = Transformer(ours.config.with_overrides(sliding_window=None)).eval()
        causal.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (causal(ids) - got).abs().max().item() > 1e-3
    if case == "llama-tied":
        assert ours.lm_head is None  # tied: the output projection reads the embedding matrix
        with HFCheckpoint(path) as ckpt:
            assert torch.equal(ckpt.read_rows("lm_head.weight", 3, 9), ckpt.read("model.embed_tokens.weight")[3:9])


def test_fused_expert_layout_loads(hf_root, tmp_path):
    """transformers 5 keeps experts fused in memory (gate_up_proj/down_proj); such files load too."""
    hf_model, path = _hf_checkpoint("mixtral-4experts-top2", hf_root)
    state = hf_model.state_dict()
    if not any(k.endswith("experts.gate_up_proj") for k in state):
        pytest.skip("this transformers version keeps Mixtral experts unfused")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"), {"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    ours = load_hf_model(tmp_path).eval()
    with torch.no_grad():
        diff = (hf_model(input_ids(VOCAB, 24)).logits - ours(input_ids(VOCAB, 24))).abs().max().item()
    report("hf", "HF mixtral (fused layout) -> Phalanx", diff)
    assert diff <= TOL


# ---- Phalanx -> transformers ------------------------------------------------------------------------------

SMALL = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96, max_seq_len=64)
OUR_CASES = {
    # name -> (config, expected architecture, max shard bytes)
    "mistral-like": (ModelConfig(**SMALL, sliding_window=8, rope_theta=1234.0, norm_eps=1e-6), "Mistral", 2**30),
    "mixtral-like-sharded": (ModelConfig(**SMALL, n_experts=4, top_k=2, rope_theta=1e6), "Mixtral", 40_000),
    "llama-like-tied": (ModelConfig(**{**SMALL, "n_kv_heads": 4}, tie_embeddings=True), "Llama", 2**30),
}


@pytest.mark.parametrize("case", list(OUR_CASES))
def test_saved_checkpoint_loads_in_transformers_with_equal_logits(case, tmp_path):
    cfg, arch, shard_bytes = OUR_CASES[case]
    model = build_model(cfg, seed=3).eval()
    perturb(model, seed=4)
    path = tmp_path / "ckpt"
    save_hf(model, cfg, path, max_shard_size_bytes=shard_bytes)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp dirs left behind
    assert (path / "model.safetensors.index.json").exists() == (shard_bytes < 2**30)

    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(hf_model).__name__ == f"{arch}ForCausalLM"
    assert getattr(hf_model.config, "sliding_window", None) == cfg.sliding_window
    assert hf_model.config.rope_parameters["rope_theta"] == cfg.rope_theta
    ids = input_ids(VOCAB, 24)
    with torch.no_grad():
        diff = (hf_model.eval()(ids).logits - model(ids)).abs().max().item()
    report("hf", f"Phalanx {case} -> HF", diff)
    assert diff <= TOL

    reloaded = load_hf_model(path)
    assert reloaded.config == cfg
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


# ---- row reads --------------------------------------------------------------------------------------------


def test_read_rows_equals_slices_of_full_tensor_across_shard_files(tmp_path):
    cfg = OUR_CASES["mixtral-like-sharded"][0]
    model = build_model(cfg, seed=5)
    save_hf(model, cfg, tmp_path / "c", max_shard_size_bytes=1)  # one tensor per file
    weight_map = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())["weight_map"]
    w1 = "model.layers.1.block_sparse_moe.experts.w1"
    assert len({weight_map[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"] for e in (1, 2)}) == 2

    params = dict(model.named_parameters())
    with HFCheckpoint(tmp_path / "c") as ckpt:
        assert ckpt.names() == list(params)
        for name, param in params.items():
            full = ckpt.read(name)
            assert torch.equal(full, param.detach()), name
            n = full.shape[0]
            for a, b in ((0, 1), (1, n - 1), (n // 2, n), (n, n)):
                assert torch.equal(ckpt.read_rows(name, a, b), full[a:b]), (name, a, b)
        assert torch.equal(ckpt.read_rows(w1, 1, 3), params[w1].detach()[1:3])
        bf16 = ckpt.read_rows("model.embed_tokens.weight", 5, 50, dtype=torch.bfloat16)
        assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, params["model.embed_tokens.weight"][5:50].bfloat16())
        with pytest.raises(ValueError, match="out of range"):
            ckpt.read_rows(w1, 2, 5)
        with pytest.raises(KeyError, match="not a parameter"):
            ckpt.read_rows("model.layers.0.mlp.gate_proj.weight", 0, 1)


def test_read_rows_slices_on_disk_and_opens_each_file_once(tmp_path, monkeypatch):
    import phalanx.models.hf as hf

    cfg = OUR_CASES["mixtral-like-sharded"][0]
    save_hf(build_model(cfg, seed=6), cfg, tmp_path / "c", max_shard_size_bytes=40_000)
    opened, sliced = [], []
    real_open = hf.safe_open

    class SpyFile:  # no get_tensor: reading a whole tensor would raise
        def __init__(self, path, framework):
            self._file = real_open(path, framework=framework)
            opened.append(os.path.basename(path))

        def keys(self):
            return self._file.keys()

        def get_slice(self, key):
            real = self._file.get_slice(key)

            class SpySlice:
                def get_shape(self):
                    return real.get_shape()

                def __getitem__(self, index):
                    sliced.append((key, index))
                    return real[index]

            return SpySlice()

    monkeypatch.setattr(hf, "safe_open", SpyFile)
    ckpt = HFCheckpoint(tmp_path / "c")
    ckpt.read_rows("model.embed_tokens.weight", 10, 20)
    ckpt.read_rows("model.layers.0.block_sparse_moe.experts.w2", 1, 3)
    ckpt.read_rows("model.layers.0.block_sparse_moe.experts.w2", 0, 1)
    assert len(opened) == len(set(opened)) > 1
    expert = "model.layers.0.block_sparse_moe.experts.{}.w2.weight"
    assert sliced == [
        ("model.embed_tokens.weight", slice(10, 20)),
        (expert.format(1), slice(None)), (expert.format(2), slice(None)), (expert.format(0), slice(None)),
    ]


def test_save_hf_gathers_dtensor_like_values_once(tmp_path):
    """Values with `full_tensor()` (DTensors) are gathered, each once, in order, also by non-writing ranks."""
    cfg = OUR_CASES["mixtral-like-sharded"][0]
    model = build_model(cfg, seed=8)
    gathered = []

    class FakeDTensor:
        def __init__(self, name, value):
            self.name, self.value, self.shape, self.dtype = name, value, value.shape, value.dtype

        def full_tensor(self):
            gathered.append(self.name)
            return self.value

    state = {k: FakeDTensor(k, v) for k, v in model.state_dict().items()}
    save_hf(state, cfg, tmp_path / "c", max_shard_size_bytes=40_000, write=False)
    assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []
    assert gathered == [name for name, _ in model.named_parameters()]
    save_hf(state, cfg, tmp_path / "c", max_shard_size_bytes=40_000)
    for name, param in load_hf_model(tmp_path / "c").named_parameters():
        assert torch.equal(param, model.get_parameter(name)), name


def test_read_rows_on_transformers_saved_sharded_checkpoint(hf_root):
    hf_model, path = _hf_checkpoint("mistral-gqa-window8-sharded", hf_root)
    hf_state = hf_model.state_dict()
    with HFCheckpoint(path) as ckpt:
        assert len({f for f in json.load(open(os.path.join(path, "model.safetensors.index.json")))[
            "weight_map"].values()}) > 1
        for name in ckpt.names():
            assert torch.equal(ckpt.read_rows(name, 2, 7), hf_state[name][2:7]), name


# ---- config.json mapping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", list(PRESETS))
def test_config_round_trip_and_transformers_reads_it(preset):
    cfg = PRESETS[preset]
    hf = config_to_hf(cfg)
    assert config_from_hf(hf) == cfg
    parsed = transformers.AutoConfig.for_model(**hf)
    assert parsed.rope_parameters["rope_theta"] == cfg.rope_theta
    assert parsed.num_key_value_heads == cfg.n_kv_heads
    assert getattr(parsed, "sliding_window", None) == cfg.sliding_window  # an explicit null, not Mistral's 4096
    assert parsed.rope_parameters["rope_type"] == cfg.rope_type
    assert parsed.rope_parameters.get("factor", 1.0) == cfg.rope_factor
    assert getattr(parsed, "head_dim", cfg.head_dim) == cfg.head_dim
    expected = "mixtral" if cfg.is_moe else "mistral" if cfg.sliding_window else "llama"
    assert hf["model_type"] == ("gpt_oss" if cfg.architecture == "gpt_oss" else expected)


_PUBLISHED_SHAPE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000,
                       hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-05, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, use_cache=True)
# config.json as published on the Hub (transformers 4.3x era: top-level rope_theta, torch_dtype).
PUBLISHED = {
    "llama2-7b": dict(_PUBLISHED_SHAPE, architectures=["LlamaForCausalLM"], model_type="llama",
                      intermediate_size=11008, max_position_embeddings=4096, num_key_value_heads=32,
                      pretraining_tp=1, rope_scaling=None, torch_dtype="float16"),
    "mistral-7b": dict(_PUBLISHED_SHAPE, architectures=["MistralForCausalLM"], model_type="mistral",
                       intermediate_size=14336, max_position_embeddings=32768, num_key_value_heads=8,
                       rope_theta=10000.0, sliding_window=4096, torch_dtype="bfloat16"),
    "mathstral-7b": dict(_PUBLISHED_SHAPE, architectures=["MistralForCausalLM"], model_type="mistral",
                         intermediate_size=14336, max_position_embeddings=32768, num_key_value_heads=8,
                         head_dim=128, rope_theta=1000000.0, sliding_window=None, vocab_size=32768,
                         attention_dropout=0.0, torch_dtype="bfloat16"),
    "mixtral-8x7b": dict(_PUBLISHED_SHAPE, architectures=["MixtralForCausalLM"], model_type="mixtral",
                         intermediate_size=14336, max_position_embeddings=32768, num_key_value_heads=8,
                         num_experts_per_tok=2, num_local_experts=8, output_router_logits=False,
                         rope_theta=1000000.0, router_aux_loss_coef=0.02, sliding_window=None,
                         attention_dropout=0.0, torch_dtype="bfloat16"),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_config_from_published_config_json_equals_preset(preset):
    assert config_from_hf(PUBLISHED[preset]) == PRESETS[preset]


def test_config_from_hf_legacy_and_default_fields():
    base = {"model_type": "mistral", **COMMON}
    assert config_from_hf({**base, "rope_theta": 321.0}).rope_theta == 321.0
    assert config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}).rope_theta == 5.0
    assert config_from_hf({**base, "rope_scaling": None, "rope_theta": 7.0}).rope_theta == 7.0
    assert config_from_hf(base).sliding_window == 4096  # transformers' Mistral default
    assert config_from_hf({**base, "sliding_window": None}).sliding_window is None
    assert config_from_hf({**base, "model_type": "llama", "sliding_window": 16}).sliding_window is None
    mixtral = config_from_hf({**base, "model_type": "mixtral"})
    assert (mixtral.rope_theta, mixtral.n_experts, mixtral.top_k) == (1e6, 8, 2)
    assert config_from_hf({**base, "num_key_value_heads": None}).n_kv_heads == 4


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "llama3"}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"head_dim": 33}, "head_dim"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method"),  # MXFP4 is read for GPT-OSS only
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_attention_heads": 5}, "n_heads"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_config_from_hf_rejects_what_it_cannot_reproduce(change, field):
    with pytest.raises(HFFormatError, match=field):
        config_from_hf({"model_type": "llama", **COMMON, **change})


def test_config_to_hf_architecture_choice():
    dense = ModelConfig(**SMALL)
    assert config_to_hf(dense)["architectures"] == ["LlamaForCausalLM"]
    assert config_to_hf(dense, "MistralForCausalLM")["sliding_window"] is None
    assert transformers.AutoConfig.for_model(**config_to_hf(dense, "MistralForCausalLM")).sliding_window is None
    with pytest.raises(HFFormatError, match="sliding_window"):
        config_to_hf(dense.with_overrides(sliding_window=8), "LlamaForCausalLM")
    with pytest.raises(HFFormatError, match="n_experts"):
        config_to_hf(dense, "MixtralForCausalLM")
    with pytest.raises(HFFormatError, match="architecture"):
        config_to_hf(dense, "GPT2LMHeadModel")


# ---- checkpoint errors ------------------------------------------------------------------------------------


def test_checkpoint_directory_errors(tmp_path):
    with pytest.raises(HFFormatError, match="not a directory"):
        HFCheckpoint(tmp_path / "missing")
    with pytest.raises(HFFormatError, match="config.json"):
        HFCheckpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(ModelConfig(**SMALL))))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(HFFormatError, match=r"\.bin checkpoints are not.*convert them to safetensors"):
        HFCheckpoint(tmp_path)


def _copy_checkpoint(src: str, dst, edit_config=None, edit_tensors=None):
    dst.mkdir()
    config = json.load(open(os.path.join(src, "config.json")))
    (dst / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    with safe_open(os.path.join(src, "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit_tensors(tensors) if edit_tensors else tensors, str(dst / "model.safetensors"), {"format": "pt"})


def test_checkpoint_content_errors(hf_root, tmp_path):
    _, src = _hf_checkpoint("llama-mha", hf_root)
    _copy_checkpoint(src, tmp_path / "wide", edit_config=lambda c: {**c, "intermediate_size": 128})
    # The message names the key and both shapes.
    shapes = r"\[(96, 64|64, 96)\].*\[(128, 64|64, 128)\]"
    with pytest.raises(HFFormatError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight.*" + shapes):
        load_hf_model(tmp_path / "wide")

    def drop(t):
        return {k: v for k, v in t.items() if k != "model.norm.weight"}

    _copy_checkpoint(src, tmp_path / "short", edit_tensors=drop)
    with pytest.raises(HFFormatError, match=r"lacks 1 tensor.*model\.norm\.weight"):
        load_hf_model(tmp_path / "short")

    def extra(t):
        return {**t, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64),
                "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}

    _copy_checkpoint(src, tmp_path / "extra", edit_tensors=extra)
    with pytest.raises(HFFormatError, match=r"1 tensor\(s\) no Phalanx parameter takes.*q_proj\.bias"):
        load_hf_model(tmp_path / "extra")


def test_save_hf_is_atomic_and_refuses_to_clobber(tmp_path, monkeypatch):
    cfg = OUR_CASES["mixtral-like-sharded"][0]
    model = build_model(cfg, seed=0)
    import phalanx.models.hf as hf

    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:
            raise OSError("disk full")
        return save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_hf(model, cfg, tmp_path / "c", max_shard_size_bytes=40_000)
    assert list(tmp_path.iterdir()) == []  # neither a half checkpoint nor a temp dir
    monkeypatch.undo()

    save_hf(model, cfg, tmp_path / "c")
    with pytest.raises(HFFormatError, match="overwrite=True"):
        save_hf(model, cfg, tmp_path / "c")
    save_hf(model.state_dict(), cfg, tmp_path / "c", overwrite=True, dtype=torch.bfloat16)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert json.loads((tmp_path / "c" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_hf_model(tmp_path / "c", dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(HFFormatError, match=r"lm_head\.weight.*shape"):
        bad = {**model.state_dict(), "lm_head.weight": torch.zeros(3, 64)}
        save_hf(bad, cfg, tmp_path / "d")
