"""Which samples each data-parallel rank reads next: a stateless, resumable global batch order.

Role: map a single integer position, ``samples_consumed`` (samples of the whole job consumed so
far, counted across epochs), to the next global batch of dataset indices, and to this rank's slice
of it. There is no other state, so resuming is "pass the saved integer", and resizing the
data-parallel group at a step boundary keeps the exact same global sequence: ranks only change
which contiguous slice of each global batch they take.

Global order: position ``p`` is sample ``perm_e(p mod N)`` of epoch ``e = p // N``, where
``perm_e`` is a pseudo-random permutation of ``range(N)`` keyed by ``(seed, e)``. It is computed per
index (a 6-round Feistel network over the smallest even-bit power of two >= N, with cycle-walking
to stay inside ``range(N)``), so construction is O(1) and a batch costs O(batch) whatever N is;
no permutation array is ever materialized. A global batch that straddles an epoch boundary simply
continues into the next epoch's permutation: within an epoch every sample appears exactly once.

Must not know about: token files, torch, torch.distributed, or how the rank learned its position.
"""

from __future__ import annotations

import hashlib

import numpy as np

from phalanx.data.errors import DataError

MAX_NUM_SAMPLES = 2**62
_FEISTEL_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a fast bijective scrambler of uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class IndexPermutation:
    """A keyed pseudo-random bijection of ``range(n)``, evaluated per index, vectorized."""

    def __init__(self, n: int, key: str) -> None:
        self.n = n
        self._half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._half_mask = np.uint64((1 << self._half_bits) - 1)
        self._round_keys = [
            np.uint64(int.from_bytes(hashlib.blake2b(f"{key}:{r}".encode(), digest_size=8).digest(), "little"))
            for r in range(_FEISTEL_ROUNDS)
        ]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        """Bijection of ``range(4**half_bits)``: balanced Feistel rounds on the two bit halves."""
        left, right = x >> np.uint64(self._half_bits), x & self._half_mask
        for round_key in self._round_keys:
            left, right = right, left ^ (_mix64(right ^ round_key) & self._half_mask)
        return (left << np.uint64(self._half_bits)) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """``perm(i)`` for every ``i`` in `indices` (each in ``range(n)``), as int64."""
        out = self._feistel(np.asarray(indices, dtype=np.uint64))
        # Cycle-walking: re-encrypt values that left range(n). The domain is < 4n, so on average
        # a few rounds suffice, and the walk from a value in range(n) always returns into it.
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._feistel(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class GlobalBatchSampler:
    """Dataset indices of global batches and of this data-parallel rank's share of them."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1,
                 *, uneven: bool = False) -> None:
        _require_int("num_samples", num_samples, minimum=1, fix="prepare a non-empty dataset")
        if num_samples > MAX_NUM_SAMPLES:
            raise DataError(f"num_samples={num_samples} exceeds the sampler's limit of {MAX_NUM_SAMPLES}")
        _require_int("global_batch_size", global_batch_size, minimum=1, fix="set global_batch_size >= 1")
        _require_int("dp_size", dp_size, minimum=1, fix="set dp_size >= 1")
        _require_int("dp_rank", dp_rank, minimum=0, fix="use a rank in [0, dp_size)")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise DataError(f"seed={seed!r} must be an integer")
        if dp_rank >= dp_size:
            raise DataError(f"dp_rank={dp_rank} must be less than dp_size={dp_size}")
        if uneven and global_batch_size < dp_size:
            raise DataError(f"global_batch_size={global_batch_size} is smaller than dp_size={dp_size}: some rank "
                            f"would get no sample; use at most {global_batch_size} data-parallel ranks")
        if global_batch_size % dp_size and not uneven:
            raise DataError(
                f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}; choose a "
                f"global batch size that is a multiple of {dp_size} (e.g. {global_batch_size - global_batch_size % dp_size or dp_size})"
            )
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.uneven = uneven  # an elastic job's size may not divide the batch: the first ranks take one more
        self._permutation: tuple[int, IndexPermutation] | None = None

    @property
    def local_batch_size(self) -> int:
        """This rank's share: global ÷ dp; uneven, the first `global % dp` ranks take one sample more."""
        base, extra = divmod(self.global_batch_size, self.dp_size)
        return base + (self.dp_rank < extra)

    @property
    def local_start(self) -> int:
        base, extra = divmod(self.global_batch_size, self.dp_size)
        return self.dp_rank * base + min(self.dp_rank, extra)

    def epoch(self, samples_consumed: int) -> int:
        """The epoch that position `samples_consumed` falls in."""
        return samples_consumed // self.num_samples

    def epoch_permutation(self, epoch: int) -> IndexPermutation:
        """The permutation of `epoch` (the last one built is kept: every step of an epoch reuses it)."""
        cached = self._permutation
        if cached is None or cached[0] != epoch:
            cached = (epoch, IndexPermutation(self.num_samples, key=f"phalanx-sampler:{self.seed}:{epoch}"))
            self._permutation = cached
        return cached[1]

    def global_batch(self, samples_consumed: int) -> np.ndarray:
        """The `global_batch_size` dataset indices at positions ``samples_consumed, ...`` (int64)."""
        _require_int("samples_consumed", samples_consumed, minimum=0, fix="pass the saved position (>= 0)")
        samples_consumed = int(samples_consumed)
        positions = np.arange(samples_consumed, samples_consumed + self.global_batch_size, dtype=np.int64)
        epochs = positions // self.num_samples
        offsets = positions % self.num_samples
        indices = np.empty(self.global_batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):  # usually one epoch, two when the batch straddles a boundary
            in_epoch = epochs == epoch
            indices[in_epoch] = self.epoch_permutation(int(epoch))(offsets[in_epoch])
        return indices

    def local_batch(self, samples_consumed: int) -> np.ndarray:
        """This rank's contiguous slice ``[rank*B/d, (rank+1)*B/d)`` of the global batch (uneven: the shares
        of the ranks before it, then its own)."""
        start = self.local_start
        return self.global_batch(samples_consumed)[start : start + self.local_batch_size]

    def local_micro_batches(self, samples_consumed: int, micro_batch_size: int,
                            count: int | None = None) -> list[np.ndarray]:
        """This rank's local batch cut into consecutive micro-batches (for gradient accumulation). `count`
        (uneven): exactly that many, of near-equal sizes (every rank of the step runs the same number)."""
        _require_int("micro_batch_size", micro_batch_size, minimum=1, fix="set micro_batch_size >= 1")
        if count is not None:
            local = self.local_batch(samples_consumed)
            if len(local) < count or -(-len(local) // count) > micro_batch_size:
                raise DataError(f"{len(local)} samples on dp rank {self.dp_rank} cannot be cut into {count} "
                                f"micro-batches of at most {micro_batch_size}")
            return np.array_split(local, count)
        if self.local_batch_size % micro_batch_size:
            raise DataError(
                f"micro_batch_size={micro_batch_size} does not divide the local batch size {self.local_batch_size} "
                f"(global_batch_size={self.global_batch_size} / dp_size={self.dp_size}); choose a divisor of "
                f"{self.local_batch_size}"
            )
        return np.split(self.local_batch(samples_consumed), self.local_batch_size // micro_batch_size)

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(num_samples={self.num_samples}, global_batch_size={self.global_batch_size}, "
            f"seed={self.seed}, dp_rank={self.dp_rank}, dp_size={self.dp_size})"
        )


def _require_int(name: str, value: object, *, minimum: int, fix: str) -> None:
    if isinstance(value, (np.integer,)):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DataError(f"{name}={value!r} must be an integer >= {minimum}; {fix}")
