"""Checkpointless recovery inside the training workers: a worker keeps its process and its state across its
peers' failures and regroups, generation after generation (`run.py`), restoring from peers' memory.

May import `phalanx.train` (the trainer, its state and callbacks); `phalanx.train` never imports this package.
Must not know: the controller beyond `phalanx.protocol` (the store keys and env it shares with the agents).
"""
