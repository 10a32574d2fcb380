"""Training: config, loop, training state, checkpoints, metrics, restart-mode workers and the local launcher.

Must not know: the controller (only `phalanx.protocol`) or checkpointless recovery — `phalanx.resilience` imports
`phalanx.train`, never the reverse (`phalanx.worker` is the one module that picks between them)."""

from phalanx.train.config import ConfigError, TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "load_config"]
