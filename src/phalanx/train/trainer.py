"""The training loop: build → (resume) → step → checkpoint, on one worker process.

`Trainer` owns the `TrainState` pieces (model, optimizer, scheduler, step, samples consumed, RNG) and runs
fixed-global-batch steps with gradient accumulation, clipping and AdamW. It expects torch.distributed to be
initialised by its caller (`phalanx.worker`, `phalanx.resilience.run`) and knows nothing about how it
was launched or how a failure is recovered from; code outside it runs at points of its loop through `callbacks`.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from phalanx.data import GlobalBatchSampler, TokenDataset
from phalanx.models import ModelConfig, Transformer, get_preset
from phalanx.models.moe import MoEFeedForward
from phalanx.parallel import (
    ParallelDims,
    build_mesh,
    clip_grad_norm_,
    dp_rank,
    materialize,
    parallelize,
    random_init_source,
)
from phalanx.train.callbacks import Callbacks
from phalanx.train.checkpoint import CheckpointManager, step_dir
from phalanx.train.config import ConfigError, TrainConfig
from phalanx.train.metrics import MetricsWriter
from phalanx.train.mfu import flops_per_token, mfu, peak_flops_per_s
from phalanx.train.optim import build_optimizer, build_scheduler
from phalanx.train.state import Progress, TrainState
from phalanx.train.tensorboard import TensorBoardScalars

log = logging.getLogger(__name__)


def resolve_model_config(config: TrainConfig) -> ModelConfig:
    if config.model.hf_path is not None:
        from phalanx.models.hf import HFCheckpoint, HFFormatError

        try:
            base = HFCheckpoint(config.model.hf_path).config
        except HFFormatError as err:
            raise ConfigError(f"model.hf_path={str(config.model.hf_path)!r}: {err}") from None
    else:
        base = get_preset(config.model.preset)
    try:
        return base.with_overrides(**config.model.overrides)
    except TypeError as err:
        raise ConfigError(f"model.overrides: {err}; valid keys: {sorted(base.to_dict())}") from None
    except ValueError as err:  # a combination the model cannot be built with (ModelConfig names the fields)
        raise ConfigError(f"model.overrides: {err}") from None


def parallel_dims(config: TrainConfig, world_size: int, model_config: ModelConfig) -> ParallelDims:
    """The parallel degrees, validated against the world size and the model (heads for tp, experts for ep)."""
    p = config.parallel
    dims = ParallelDims(world_size, p.dp_replicate, p.dp_shard, tp=p.tensor_parallel_degree, ep=p.expert_parallel_degree)
    dims.check_model(n_heads=model_config.n_heads, n_kv_heads=model_config.n_kv_heads, n_experts=model_config.n_experts,
                     attention_sinks=model_config.has_attention_sinks)
    return dims


def check_data_fits_model(dataset: TokenDataset, model_config: ModelConfig) -> None:
    """The token file's vocabulary and block size must fit the model."""
    dataset.check_vocab(model_config.vocab_size)
    if dataset.meta.block_size > model_config.max_seq_len:
        raise ConfigError(
            f"data block_size {dataset.meta.block_size} exceeds the model's max_seq_len "
            f"{model_config.max_seq_len}; re-prepare the data with a smaller --block-size"
        )


class Trainer:
    """One worker's training state and loop on the current process group.

    `init_weights=False` allocates the local shards without initialising them: for a process whose state
    is about to be restored from a peer's memory (checkpointless recovery); `initialize_weights()` runs
    the deterministic init later if it is needed after all.
    """

    def __init__(self, config: TrainConfig, device: torch.device, *, init_weights: bool = True):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        config = config.for_world(self.world_size)  # an elastic job: this generation's replica count
        self.config = config
        self.device = device
        self.model_config = resolve_model_config(config)
        self.dims = parallel_dims(config, self.world_size, self.model_config)
        self.accum = config.grad_accum_steps(self.dims.dp_size)
        self.mesh = build_mesh(self.dims, device.type)
        self.dp_rank = dp_rank(self.mesh)

        self.dataset = TokenDataset(config.data.path, split=config.data.split)
        check_data_fits_model(self.dataset, self.model_config)
        self.sampler = GlobalBatchSampler(
            num_samples=len(self.dataset),
            global_batch_size=config.training.global_batch_size,
            seed=config.seed,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp_size,
            uneven=config.elastic is not None,
        )
        self.model = self._build_model()
        self.moe_blocks = [m for m in self.model.modules() if isinstance(m, MoEFeedForward)]
        self.ready = init_weights  # the local state is valid (initialised, loaded or restored)
        if init_weights:
            self.initialize_weights()
        else:
            self.model.to_empty(device=device)
            self.model.reset_buffers()
        self.optimizer = build_optimizer(self.model, config)
        # The sharded parameters by name, captured while the model is sharded (FSDP swaps in unsharded
        # tensors during forward/backward; the optimizer keeps these same objects): what a peer restores.
        self.sharded_params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self.scheduler = build_scheduler(self.optimizer, config)
        self.progress = Progress()
        self.resumed_from: dict | None = None  # what `maybe_resume` loaded (step, world sizes, seconds)
        self.last_record: dict | None = None  # the newest step's record (every rank has it: the loss is reduced)
        self._saved_step: int | None = None
        self.callbacks = Callbacks()  # what others run at points of the loop (progress reports, drills)
        # Checkpoints asked for between the intervals (`phalanx job checkpoint`, Slurm's time-limit warning): an
        # object with pending_checkpoint() -> request id or 0 and checkpoint_served(id), the worker's progress
        # reporter under an agent. The step every rank has seen a request in ends with a save (`train_step`).
        self.checkpoint_requests = None
        self._save_requested, self._serving = False, 0
        self._requested_saves: dict[int, int] = {}  # step → the request its save serves (until committed)
        # MFU: known when the config gives the peak or the GPU's name is in the table (never on CPU by default)
        self.flops_per_token = flops_per_token(self.model_config, self.dataset.meta.block_size)
        self.peak_flops_per_s = config.metrics.peak_flops_per_s or peak_flops_per_s(
            torch.cuda.get_device_name(device) if device.type == "cuda" else None, config.precision)
        scalars = (TensorBoardScalars(config.run_dir / "tensorboard")
                   if config.metrics.tensorboard and self.rank == 0 else None)
        self.metrics = MetricsWriter(config.run_dir, enabled=self.rank == 0, max_steps=config.training.max_steps,
                                     events_dir=config.checkpoint_dir,  # the run's events.jsonl: the job's run dir
                                     scalars=scalars)
        self.checkpoints = CheckpointManager(
            config.checkpoint_dir,
            keep=config.checkpoint.keep,
            async_save=config.checkpoint.async_save,
            verify_checksums=config.checkpoint.verify_checksums,
            on_commit=self._checkpoint_committed,
            metadata={"model": self.model_config.to_dict()},
        )

    # ---- build ----------------------------------------------------------------------------------
    def _build_model(self) -> Transformer:
        with torch.device("meta"):
            model = Transformer(self.model_config)
        ac = self.config.activation_checkpointing
        return parallelize(model, self.mesh, precision=self.config.precision,
                           reshard_after_forward=self.config.reshard_after_forward, ac_mode=ac.mode, ac_every=ac.every,
                           compile=self.config.compile)

    def initialize_weights(self) -> None:
        """Fill this rank's shards: from the Hugging Face checkpoint in `model.hf_path`, else the seeded init."""
        if self.config.model.hf_path is not None:
            from phalanx.models.hf import HFCheckpoint

            hf = HFCheckpoint(self.config.model.hf_path)
            source = lambda name, shape, a, b, dtype: hf.read_rows(name, a, b, dtype)  # noqa: E731
        else:
            source = random_init_source(self.model, self.config.seed)
        materialize(self.model, self.device, source)

    @property
    def local_numel(self) -> int:
        return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in self.sharded_params.values())

    # ---- checkpoint state -----------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        """This rank's training state (a view over the live objects): what checkpoints and peers restore."""
        return TrainState(self.model, self.optimizer, self.scheduler, self.progress, self.sharded_params)

    def save_checkpoint(self) -> None:
        """Synchronous: `checkpoint_saved` once committed. Async: `checkpoint_started` when training may go on
        (`seconds`: the time it blocked), `checkpoint_saved` when the save commits (at the next save or at the
        end)."""
        self.callbacks.before_save(self, self.progress.step)
        start = time.perf_counter()
        self.checkpoints.save(self.progress.step, self.state.checkpoint_items(self.rank, self.world_size))
        if self.config.checkpoint.async_save:
            self.metrics.event("checkpoint_started", step=self.progress.step,
                               seconds=round(time.perf_counter() - start, 3), dir=str(self.config.checkpoint_dir))

    def _checkpoint_committed(self, step: int, seconds: float) -> None:
        extra = {"async": True} if self.config.checkpoint.async_save else {}
        if step in self._requested_saves:  # asked for between the intervals: which request it serves
            extra.update(requested=True, request=self._requested_saves.pop(step))
        self.metrics.event("checkpoint_saved", step=step, seconds=round(seconds, 3),
                           dir=str(self.config.checkpoint_dir), **extra)

    def maybe_resume(self, announce: bool = True) -> bool:
        """Load the newest valid checkpoint, if any; `announce`: write the `resumed` event (checkpointless
        recovery writes its own, after its `state_restored`)."""
        if not self.config.checkpoint.resume:
            return False
        step, skipped = self.checkpoints.latest_valid_step()
        for bad_step, problem in skipped:
            self.metrics.event("checkpoint_skipped", step=bad_step, reason=problem)
        if step is None:
            return False
        self.check_checkpoint_model(step)
        start = time.perf_counter()
        saved_world = self.state.load_checkpoint(lambda items: self.checkpoints.load(step, items),
                                                 self.rank, self.world_size)
        self.resumed_from = {"step": self.progress.step, "samples_consumed": self.progress.samples_consumed,
                             "from_world_size": saved_world, "world_size": self.world_size,
                             "seconds": round(time.perf_counter() - start, 3)}
        if announce:
            self.metrics.event("resumed", **self.resumed_from)
        return True

    def check_checkpoint_model(self, step: int) -> None:
        """Refuse (ConfigError, on every rank alike) a checkpoint recorded for another model. Parallel degrees
        and world size may differ (the checkpoint reshards); a checkpoint without a recorded model config
        (written before Phalanx recorded it) is not checked."""
        recorded = self.checkpoints.metadata_of(step).get("model")
        if not isinstance(recorded, dict):
            return
        diffs = self.model_config.differences(recorded)
        if diffs:
            where = "checkpoint.dir" if self.config.checkpoint.dir is not None else "run_dir"
            shown = ", ".join(f"{name} {theirs} (checkpoint) vs {ours} (this run)"
                              for name, (theirs, ours) in diffs.items())
            raise ConfigError(
                f"checkpoint {step_dir(self.config.checkpoint_dir, step)} was written for a different model: "
                f"{shown}; resume with the same model settings (model.preset / model.hf_path / "
                f"model.overrides), or point {where} elsewhere to start a new run"
            )

    # ---- the step -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg = self.config
        start, cpu_start = time.perf_counter(), time.process_time()
        gb = cfg.training.global_batch_size
        micro_batches = self.sampler.local_micro_batches(
            self.progress.samples_consumed, cfg.training.micro_batch_size,
            self.accum if self.sampler.uneven else None,
        )
        assert len(micro_batches) == self.accum, (len(micro_batches), self.accum)
        # Each micro-batch's loss counts by its share of the global batch: data-parallel reduction averages over
        # the dp ranks, so a divisor of global ÷ (its samples × dp) makes the gradient the global batch's mean
        # even where shares are uneven (an elastic size that does not divide the batch); evenly, it is `accum`.
        divisors = [gb / (len(indices) * self.dims.dp_size) for indices in micro_batches]
        even = all(d == self.accum for d in divisors)
        loss_sum = torch.zeros((), device=self.device)
        routed = (torch.zeros(self.model_config.n_experts + 1, dtype=torch.float64, device=self.device)
                  if self.moe_blocks else None)
        for indices, divisor in zip(micro_batches, divisors):
            tokens = self.dataset.get_batch(indices).to(self.device, non_blocking=True)
            loss, _aux = self.model(tokens, tokens)
            if routed is not None:  # read before backward: activation checkpointing re-runs the forward
                routed += self._routed_pairs()
            (loss / (self.accum if even else divisor)).backward()
            loss_sum += loss.detach() if even else loss.detach() / divisor
        # Mean loss over the global batch (every data-parallel rank contributes equally), reduced before the
        # update: after it there is no collective left in the step, so a peer's fault surfaces before this
        # rank commits a step it could not log.
        loss_mean = loss_sum / self.accum if even else loss_sum
        # The same all-reduce counts the ranks that have seen a checkpoint request (no collective of its own):
        # every rank learns the same count, so they all save after this step, or none does.
        request = self.checkpoint_requests.pending_checkpoint() if self.checkpoint_requests is not None else 0
        reduced = torch.stack([loss_mean, loss_mean.new_full((), 1.0 if request else 0.0)])  # (a fill, no copy:
        # a host-to-GPU copy would wait for the backward to finish before the optimizer step is queued)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        loss_mean, seen_by = reduced[0] / self.world_size, reduced[1]
        max_norm = cfg.optimizer.grad_clip if cfg.optimizer.grad_clip > 0 else float("inf")
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)  # across FSDP/TP/EP meshes
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The update is applied: from here on, this rank's state *is* the next step's.
        self.progress.step += 1
        self.progress.samples_consumed += cfg.training.global_batch_size

        if self.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        # This rank's own compute: on a CPU device its CPU seconds, which leave out the time it waited on slower
        # peers in a collective (the wall time above is the same on every rank of a synchronous step). A GPU's
        # kernels are not CPU time: there it is the wall time (the straggler rule then sees no difference).
        compute_time = time.process_time() - cpu_start if self.device.type == "cpu" else step_time

        tokens_per_step = cfg.training.global_batch_size * self.dataset.meta.block_size
        # Every rank saw a request: save after this step; each rank's own request is served. (Ranks may have read
        # different ids; one a rank reads later was then written before this save: the others have served it,
        # so the count never reaches the world size for it alone.)
        self._save_requested = int(seen_by.item()) == self.world_size
        if self._save_requested:
            self.checkpoint_requests.checkpoint_served(request)
            self._serving = request
        record = {
            "step": self.progress.step,
            "loss": loss_mean.item(),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens_per_s": tokens_per_step / step_time,
            "step_time_s": step_time,
            "compute_time_s": compute_time,
            "samples_consumed": self.progress.samples_consumed,
        }
        if self.peak_flops_per_s:
            record["mfu"] = mfu(record["tokens_per_s"], self.flops_per_token, self.peak_flops_per_s, self.world_size)
        if routed is not None:  # MoE: how the global batch was routed
            counts = [int(v) for v in routed.tolist()]
            record.update(tokens_per_expert=counts[:-1], dropped_pairs=counts[-1])
        return record

    def _routed_pairs(self) -> torch.Tensor:
        """(token, expert) pairs routed to each expert by the last forward, summed over the MoE layers, then
        the pairs dropped over capacity: [n_experts + 1]. The blocks count over the data-parallel group
        (`apply_ep`), so the figures are the global batch's."""
        return torch.cat([torch.stack([b.tokens_per_expert for b in self.moe_blocks]).sum(0),
                          torch.stack([b.dropped_pairs for b in self.moe_blocks]).sum().reshape(1)]).double()

    def follow_scaled_lr(self) -> None:
        """An elastic job with `scale_batch`: the schedule's peak is this size's learning rate (`config.optimizer.lr`,
        scaled by `TrainConfig.for_world`). A state restored from another size carries that size's peak in the
        scheduler's base and the optimizer's current lr: both are set to this size's, at the same point of the
        schedule. Nothing changes for any other job."""
        if self.config.elastic is None or not self.config.elastic.scale_batch:
            return
        base = self.config.optimizer.lr
        lrs = [base * fn(self.scheduler.last_epoch) for fn in self.scheduler.lr_lambdas]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"], group["initial_lr"] = lr, base
        self.scheduler.base_lrs = [base] * len(lrs)
        self.scheduler._last_lr = lrs  # what get_last_lr() reports for the next step

    def start(self, announce: bool = True) -> None:
        """Resume from the newest valid checkpoint, or record a fresh start."""
        if self.maybe_resume(announce):
            self.follow_scaled_lr()
            self._saved_step = self.progress.step
        else:
            self.metrics.event(
                "started",
                world_size=self.world_size,
                layout=self.dims.describe(),
                grad_accum=self.accum,
                model_params=self.model_config.num_params(),
                local_params=self.local_numel,
            )

    @property
    def done(self) -> bool:
        return self.progress.step >= self.config.training.max_steps

    def advance(self) -> dict:
        """One step, logged, and checkpointed every `checkpoint.interval` steps and at the last one."""
        cfg = self.config
        self.callbacks.on_step_start(self, self.progress.step)
        record = self.last_record = self.train_step()
        self.callbacks.on_step_end(self, record)
        step, interval, max_steps = record["step"], cfg.checkpoint.interval, cfg.training.max_steps
        self.metrics.step(record, print_line=step % cfg.training.log_interval == 0 or step == max_steps)
        if self._save_requested:
            self._requested_saves[step] = self._serving
        if (interval and step % interval == 0) or step == max_steps or self._save_requested:
            self.save_checkpoint()
            self._saved_step = step
        return record

    def finish(self) -> None:
        """Save the final state if not saved yet, wait for saves in flight, record the end."""
        if self._saved_step != self.progress.step:
            self.save_checkpoint()
        self.checkpoints.close()
        self.metrics.event("finished", step=self.progress.step, samples_consumed=self.progress.samples_consumed)

    def abandon(self) -> None:
        """After a fault: let go of everything tied to this generation's process groups (model, optimizer,
        mesh, a checkpoint save in flight), so their sockets close and peers blocked on them fail at once."""
        self.metrics.close()
        self.checkpoints.abandon()
        self.sharded_params = {}
        self.model = self.optimizer = self.scheduler = self.mesh = None
        self.ready = False

    def fit(self) -> Progress:
        """Train to `training.max_steps`, checkpointing every `checkpoint.interval` steps and at the end."""
        try:
            self.start()
            while not self.done:
                self.advance()
            self.finish()
        finally:
            self.metrics.close()
        return self.progress
