"""Training: config, loop, checkpoints, metrics, and the local launcher."""

from phalanx.train.config import ConfigError, TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "load_config"]
