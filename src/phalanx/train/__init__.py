"""Training: config, loop, training state, checkpoints, metrics and the local launcher (restart mode, the loop
run to the end in one worker process, is `phalanx.worker`).

Must not know: the controller (only `phalanx.protocol`) or checkpointless recovery — `phalanx.resilience` imports
`phalanx.train`, never the reverse (`phalanx.worker` is the one module that picks between them)."""

from phalanx.train.config import ConfigError, TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "load_config"]
