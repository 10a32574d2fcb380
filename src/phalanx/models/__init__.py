"""Plain PyTorch models (no torch.distributed): Llama-family dense decoders (Llama 2 / 3.x, Mistral), Mixtral-style
MoE and GPT-OSS, and Hugging Face interop. Must not know: parallelism, data, the training loop, recovery or the
controller."""

from phalanx.models.config import PRESETS, ModelConfig, get_preset
from phalanx.models.init import init_weights
from phalanx.models.llama import Transformer

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "get_preset", "init_weights"]


def build_model(config: ModelConfig, *, seed: int | None = 0, device="cpu") -> Transformer:
    """Build a model; with `seed`, initialise it (seed=None leaves it uninitialised, e.g. on meta)."""
    import torch

    with torch.device(device):
        model = Transformer(config)
    if seed is not None and str(device) != "meta":
        init_weights(model, seed)
    return model
