"""Helpers the logit comparisons against transformers share (test_hf, test_llama3, test_gpt_oss): a seeded
input, random offsets on every weight, and the measured difference printed (run pytest with -s)."""

from __future__ import annotations

import torch

TOL = 1e-5  # max |logits diff| allowed, fp32


def input_ids(vocab: int, length: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(7))


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Random offsets on every weight: norms not all ones, biases and sinks not zero, routing not uniform."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def report(family: str, label: str, diff: float) -> None:
    print(f"\n[{family}] {label}: max |logits diff| = {diff:.2e} (tolerance {TOL:.0e})")
