"""Expert parallelism: degree checks, dispatch numerics against the single-process model, capacity, training
end to end with ep = 2 on 4 processes, and resuming a checkpoint with a different ep (real processes, gloo)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_training, tiny_config
from distributed import run_distributed
from layouts import global_batch, max_grad_diff, reference, run_layouts
from phalanx.models.moe import MoEFeedForward, capacity_mask, expert_swiglu
from phalanx.parallel import ParallelConfigError, ParallelDims
from phalanx.train.checkpoint import committed_steps
from phalanx.train.config import load_config
from phalanx.train.metrics import read_metrics
from phalanx.train.trainer import parallel_dims, resolve_model_config

RECIPES = Path(__file__).parent.parent / "recipes"
SEED = 3


# ---- degrees --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "degrees, model, words",
    [
        (dict(world_size=4, ep=3), dict(n_experts=8), ["expert_parallel_degree=3", "dp_shard=4", "[1, 2, 4]"]),
        (dict(world_size=12, ep=3), dict(n_experts=8), ["expert_parallel_degree=3", "n_experts=8", "[1, 2, 4]"]),
        (dict(world_size=8, dp_replicate=2, ep=8), dict(n_experts=8), ["expert_parallel_degree=8", "dp_shard=4"]),
        (dict(world_size=4, ep=2, tp=2), dict(n_experts=8), ["expert_parallel_degree=2", "tensor_parallel_degree=2",
                                                             "not supported"]),
        (dict(world_size=4, ep=2), dict(n_experts=0), ["expert_parallel_degree=2", "n_experts=0"]),
        (dict(world_size=4, tp=2), dict(n_experts=8, attention_sinks=True),
         ["tensor_parallel_degree=2", "attention sinks", "tensor_parallel_degree=1"]),
    ],
)
def test_ep_degree_errors_name_field_value_and_valid_values(degrees, model, words):
    with pytest.raises(ParallelConfigError) as err:
        ParallelDims(**degrees).check_model(n_heads=4, n_kv_heads=2, **model)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_recipes_carry_a_valid_expert_parallel_layout():
    tiny = load_config(RECIPES / "tiny-mixtral.yaml")
    dims = parallel_dims(tiny, 4, resolve_model_config(tiny))
    assert (dims.dp_shard, dims.ep) == (4, 2)
    mixtral = load_config(RECIPES / "mixtral-8x7b.yaml")
    dims = parallel_dims(mixtral, 16, resolve_model_config(mixtral))  # 2 nodes × 8 GPUs
    assert (dims.dp_replicate, dims.dp_shard, dims.ep) == (1, 16, 8)
    assert mixtral.grad_accum_steps(dims.dp_size) == 8
    gpt_oss = load_config(RECIPES / "gpt-oss-20b.yaml")
    dims = parallel_dims(gpt_oss, 8, resolve_model_config(gpt_oss))  # 1 node × 8 GPUs
    assert (dims.dp_shard, dims.ep) == (8, 8) and gpt_oss.grad_accum_steps(dims.dp_size) == 8
    tiny_gpt_oss = load_config(RECIPES / "tiny-gpt-oss.yaml")
    assert parallel_dims(tiny_gpt_oss, 4, resolve_model_config(tiny_gpt_oss)).ep == 2
    with pytest.raises(ParallelConfigError, match="attention sinks"):
        tp = load_config(RECIPES / "gpt-oss-20b.yaml", ["parallel.expert_parallel_degree=1", "parallel.dp_shard=1",
                                                        "parallel.tensor_parallel_degree=8"])
        parallel_dims(tp, 8, resolve_model_config(tp))
    one_node = load_config(RECIPES / "mixtral-8x7b.yaml", ["parallel.dp_shard=4"])
    with pytest.raises(ParallelConfigError, match="expert_parallel_degree=8 does not divide"):
        parallel_dims(one_node, 4, resolve_model_config(one_node))


# ---- single-process pieces ------------------------------------------------------------------------
def test_capacity_keeps_first_choices_first_then_token_order():
    # 4 tokens, top-2, 2 experts; capacity = ceil(0.5 × 4 × 2 / 2) = 2 pairs per expert.
    top_idx = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    keep = capacity_mask(top_idx, 2, 0.5)
    # expert 0 queue: first choices of tokens 0, 1, 2 (only 0 and 1 fit), then token 3's second choice;
    # expert 1 queue: token 3's first choice, then second choices of tokens 0, 1, 2 (only token 0 fits).
    assert keep.tolist() == [[True, True], [True, False], [False, False], [True, False]]
    assert capacity_mask(top_idx, 2, None) is None


def test_dropped_pairs_are_counted_and_their_tokens_pass_through():
    from layouts import model_config

    torch.manual_seed(0)
    moe = MoEFeedForward(model_config("tiny-moe", capacity_factor=0.25))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 64, moe.gate.weight.shape[1])
    out, _ = moe(x)
    _, _, top_idx = moe.route(x.reshape(64, -1))
    keep = capacity_mask(top_idx, moe.n_experts, 0.25)
    assert int(moe.dropped_pairs) == int((~keep).sum()) > 0
    assert int(moe.tokens_per_expert.sum()) == 64 * moe.top_k  # routed pairs, before the capacity cut
    fully_dropped = ~keep.any(dim=1)
    assert fully_dropped.any()
    assert torch.equal(out[0, fully_dropped], torch.zeros_like(out[0, fully_dropped]))
    assert out[0, ~fully_dropped].abs().sum(-1).gt(0).all()


def test_grouped_matmul_equals_the_per_expert_loop():
    torch.manual_seed(0)
    w1, w3 = torch.randn(4, 64, 32, requires_grad=True), torch.randn(4, 64, 32, requires_grad=True)
    w2 = torch.randn(4, 32, 64, requires_grad=True)
    x = torch.randn(40, 32, requires_grad=True)
    counts = [10, 0, 25, 5]
    grouped = expert_swiglu(x, counts, w1, w2, w3)
    grads = torch.autograd.grad(grouped.square().sum(), (x, w1, w2, w3))
    loop = torch.cat([torch.nn.functional.linear(torch.nn.functional.silu(c @ w1[e].T) * (c @ w3[e].T), w2[e])
                      for e, c in enumerate(torch.split(x, counts))])
    loop_grads = torch.autograd.grad(loop.square().sum(), (x, w1, w2, w3))
    assert torch.allclose(grouped, loop, atol=1e-5)
    for a, b in zip(grads, loop_grads):
        assert torch.allclose(a, b, atol=1e-4)
    assert grads[1][1].abs().sum() == 0  # the expert without tokens still has a (zero) gradient


def test_source_major_to_expert_major_order():
    from phalanx.parallel.ep import _source_major_to_expert_major

    counts = torch.tensor([[2, 1], [0, 3]])  # from source 0: 2 rows for expert 0, 1 for expert 1; source 1: 0, 3
    rows = ["s0e0a", "s0e0b", "s0e1", "s1e1a", "s1e1b", "s1e1c"]
    order = _source_major_to_expert_major(counts)
    assert [rows[i] for i in order] == ["s0e0a", "s0e0b", "s0e1", "s1e1a", "s1e1b", "s1e1c"]
    counts = torch.tensor([[1, 2], [2, 1]])
    rows = ["s0e0", "s0e1a", "s0e1b", "s1e0a", "s1e0b", "s1e1"]
    assert [rows[i] for i in _source_major_to_expert_major(counts)] == ["s0e0", "s1e0a", "s1e0b", "s0e1a", "s0e1b",
                                                                        "s1e1"]


# ---- numerics on 4 processes ----------------------------------------------------------------------
CASES = [
    {"name": "ep1", "preset": "tiny-moe", "degrees": {}},
    {"name": "ep2", "preset": "tiny-moe", "degrees": {"ep": 2}},
    {"name": "ep4", "preset": "tiny-moe", "degrees": {"ep": 4}},
    {"name": "hsdp2x2-ep2", "preset": "tiny-moe", "degrees": {"dp_replicate": 2, "ep": 2}},
    {"name": "capacity-ep1", "preset": "tiny-moe", "degrees": {}, "overrides": {"capacity_factor": 0.5}},
    {"name": "capacity-ep4", "preset": "tiny-moe", "degrees": {"ep": 4}, "overrides": {"capacity_factor": 0.5}},
]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tokens = global_batch()
    results = run_distributed(run_layouts, 4, tmp_path_factory.mktemp("ep"), CASES, tokens, SEED)[0]
    return results, reference("tiny-moe", tokens, SEED)


@pytest.mark.parametrize("name", ["ep1", "ep2", "ep4", "hsdp2x2-ep2"])
def test_expert_parallel_loss_and_gradients_equal_the_single_process_model(four_ranks, name):
    results, ref = four_ranks
    got = results[name]
    assert abs(got["loss"] - ref["loss"]) <= 1e-5, (got["loss"], ref["loss"])
    assert abs(got["aux"] - ref["aux"]) <= 1e-6, "the aux loss must use the global token counts"
    assert max_grad_diff(got["grads"], ref["grads"]) <= 1e-5
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5
    assert got["load"]["tokens_per_expert"] == ref["load"]["tokens_per_expert"]  # global counts
    assert sum(got["load"]["tokens_per_expert"]) == 8 * 32 * 2 * 2  # tokens × top-2 × 2 layers


@pytest.mark.parametrize("name, ep, expert_dp", [("ep2", 2, 2), ("ep4", 4, 1), ("hsdp2x2-ep2", 2, 1)])
def test_experts_are_split_over_ep_and_sharded_over_the_rest(four_ranks, name, ep, expert_dp):
    results, ref = four_ranks
    got = results[name]
    w1 = "model.layers.0.block_sparse_moe.experts.w1"
    experts, inter, dim = ref["params"][w1].shape
    assert got["local_shapes"][w1] == (experts // ep, inter // expert_dp, dim)
    assert got["local_shapes"]["model.layers.0.self_attn.q_proj.weight"][0] == (64 if "hsdp" in name else 32)
    for n, value in got["params"].items():  # delayed init of the shards equals the single-process init
        assert torch.equal(value, ref["params"][n]), n


# GPT-OSS's MoE (biased router, clamped SwiGLU experts with biases) and sink attention under the same layouts;
# full activation checkpointing on two of them (the recomputed forward dispatches again).
GPT_OSS_CASES = [
    {"name": "fsdp4", "preset": "tiny-gpt-oss", "degrees": {}},
    {"name": "ep2-ac", "preset": "tiny-gpt-oss", "degrees": {"ep": 2}, "ac": "full"},
    {"name": "ep4", "preset": "tiny-gpt-oss", "degrees": {"ep": 4}},
    {"name": "hsdp2x2-ep2-ac", "preset": "tiny-gpt-oss", "degrees": {"dp_replicate": 2, "ep": 2}, "ac": "full"},
]


@pytest.fixture(scope="module")
def gpt_oss_four_ranks(tmp_path_factory):
    tokens = global_batch()
    results = run_distributed(run_layouts, 4, tmp_path_factory.mktemp("ep-gpt-oss"), GPT_OSS_CASES, tokens, SEED)[0]
    return results, reference("tiny-gpt-oss", tokens, SEED)


@pytest.mark.slow
@pytest.mark.parametrize("name", [case["name"] for case in GPT_OSS_CASES])
def test_gpt_oss_fsdp_ep_and_checkpointing_equal_the_single_process_model(gpt_oss_four_ranks, name):
    results, ref = gpt_oss_four_ranks
    got = results[name]
    assert abs(got["loss"] - ref["loss"]) <= 1e-5, (got["loss"], ref["loss"])
    assert abs(got["aux"] - ref["aux"]) <= 1e-6
    assert max_grad_diff(got["grads"], ref["grads"]) <= 1e-5
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5
    assert got["load"]["tokens_per_expert"] == ref["load"]["tokens_per_expert"]
    assert sum(got["load"]["tokens_per_expert"]) == 8 * 32 * 2 * 2  # tokens × top-2 × 2 layers
    for n, value in got["params"].items():
        assert torch.equal(value, ref["params"][n]), n
    # every GPT-OSS-only parameter took part: sinks, router bias and expert biases have gradients
    for n in ("self_attn.sinks", "mlp.router.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):
        assert got["grads"][f"model.layers.1.{n}"].abs().sum() > 0, n
    ep = {"ep2-ac": 2, "ep4": 4, "hsdp2x2-ep2-ac": 2}.get(name, 1)
    expert_dp = 4 // ep if "hsdp" not in name else 1
    experts, dim, inter2 = ref["params"]["model.layers.0.mlp.experts.gate_up_proj"].shape
    local = got["local_shapes"]
    if ep > 1:
        assert local["model.layers.0.mlp.experts.gate_up_proj"] == (experts // ep, dim // expert_dp, inter2)
        assert local["model.layers.0.mlp.experts.down_proj_bias"] == (experts // ep, dim // expert_dp)


def test_capacity_drops_the_same_pairs_whatever_ep(four_ranks):
    results, _ = four_ranks
    ep1, ep4 = results["capacity-ep1"], results["capacity-ep4"]
    assert ep1["load"]["dropped_pairs"] > 0
    assert ep1["load"]["dropped_pairs"] == ep4["load"]["dropped_pairs"]
    assert abs(ep1["loss"] - ep4["loss"]) <= 1e-5
    assert max_grad_diff(ep1["grads"], ep4["grads"]) <= 1e-5
    assert abs(ep1["loss"] - results["ep1"]["loss"]) > 1e-4, "dropping pairs must change the output"


# ---- training end to end --------------------------------------------------------------------------
def moe_config(run_dir, data, ep: int, max_steps: int, ac: str = "none", preset: str = "tiny-moe"):
    return tiny_config(run_dir, data, model={"preset": preset, "overrides": {"vocab_size": 512, "n_layers": 2}},
                       parallel={"expert_parallel_degree": ep}, training={"max_steps": max_steps},
                       checkpoint={"interval": 4, "keep": 10}, activation_checkpointing={"mode": ac})


def losses(steps):
    return {s["step"]: s["loss"] for s in steps}


@pytest.mark.slow
def test_train_with_ep2_on_4_processes_and_resume_with_ep4_and_ep1(tmp_path, demo_data):
    run_dir = tmp_path / "ep2"
    # Full activation checkpointing: the recomputed forward dispatches again (and must match); the resumed
    # runs below go without it (same numerics).
    steps = run_training(moe_config(run_dir, demo_data, ep=2, max_steps=8, ac="full"), nproc=4)
    ref = losses(steps)
    assert sorted(ref) == list(range(1, 9)) and ref[8] < ref[1] - 0.3, "the model should learn"
    # each step's record says how the global batch was routed: 8 samples × 64 tokens × top-2 × 2 MoE layers
    # (counted once although the checkpointed forward runs again in backward), none dropped (dropless)
    assert all(sum(s["tokens_per_expert"]) == 8 * 64 * 2 * 2 and len(s["tokens_per_expert"]) == 8
               and s["dropped_pairs"] == 0 for s in steps), [s["tokens_per_expert"] for s in steps]
    _, events = read_metrics(run_dir)
    assert "experts over EP 2" in next(e for e in events if e["event"] == "started")["layout"]

    for ep in (4, 1):  # resume step 4's checkpoint (saved with ep=2) with another ep: experts reshard on load
        resumed_dir = tmp_path / f"resume-ep{ep}"
        shutil.copytree(run_dir / "checkpoints" / "step-00000004", resumed_dir / "checkpoints" / "step-00000004")
        resumed = losses(run_training(moe_config(resumed_dir, demo_data, ep=ep, max_steps=8), nproc=4))
        assert sorted(resumed) == list(range(5, 9))
        for step in range(5, 9):
            assert abs(resumed[step] - ref[step]) <= 1e-5, (ep, step, resumed[step], ref[step])
        assert committed_steps(resumed_dir / "checkpoints")[0] == 8


@pytest.mark.slow
def test_tiny_gpt_oss_trains_with_ep2_and_checkpointing_on_cpu(tmp_path, demo_data):
    steps = run_training(moe_config(tmp_path / "gpt-oss", demo_data, ep=2, max_steps=8, ac="full",
                                    preset="tiny-gpt-oss"), nproc=2)
    ref = losses(steps)
    assert sorted(ref) == list(range(1, 9)) and ref[8] < ref[1] - 0.3, "the model should learn"
    assert all(sum(s["tokens_per_expert"]) == 8 * 64 * 2 * 2 and s["dropped_pairs"] == 0 for s in steps)
    _, events = read_metrics(tmp_path / "gpt-oss")
    assert "experts over EP 2" in next(e for e in events if e["event"] == "started")["layout"]
