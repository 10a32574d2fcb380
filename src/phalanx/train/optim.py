"""AdamW and the warmup + cosine learning-rate schedule. Knows nothing about parallelism or data."""

from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.train.config import TrainConfig


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based count of steps already taken)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D params), as in Llama/Mistral pretraining."""
    opt = config.optimizer
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": opt.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    schedule = config.lr_schedule
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            warmup_steps=schedule.warmup_steps,
            decay_steps=config.decay_steps,
            min_lr_ratio=schedule.min_lr_ratio,
        ),
    )
