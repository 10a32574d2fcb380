"""Random access to prepared token blocks, memory-mapped from ``<split>.bin``.

Role: open a token file written by `prepare` in O(1) (read the small metadata JSON, stat the
``.bin``, map it read-only; never read or scan the tokens) and hand out samples by index:
``ds[i]`` is one block of ``block_size`` token ids, ``ds.get_batch(indices)`` a ``[B, block_size]``
int64 tensor gathered with one fancy index on the map. The OS page cache does the caching.

Which indices to read, in what order, on which rank, is the sampler's job, not this module's.

Must not know about: text formats, tokenizers, samplers, ranks, or torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from phalanx.data.errors import DataError
from phalanx.data.token_file import TokenFileMeta, read_meta


class TokenDataset:
    """The samples of one split of a prepared dataset.

    `path` is either the directory `prepare` wrote (then ``<split>.bin`` inside it is used) or a
    ``.bin`` file directly (then `split` is ignored).
    """

    def __init__(self, path: str | Path, split: str = "train") -> None:
        path = Path(path)
        self.bin_path = path / f"{split}.bin" if path.is_dir() else path
        if not self.bin_path.is_file():
            hint = f" (no {split!r} split there? prepare with --val-percent > 0 for 'val')" if path.is_dir() else ""
            raise DataError(f"token file {self.bin_path} not found{hint}; run `phalanx data prepare` first")
        self.meta: TokenFileMeta = read_meta(self.bin_path)
        self._check_file_size()
        self._blocks = self._open_blocks()

    def _check_file_size(self) -> None:
        actual = self.bin_path.stat().st_size
        expected = self.meta.expected_file_bytes
        if actual != expected:
            raise DataError(
                f"token file {self.bin_path} is {actual} bytes but its metadata says {self.meta.num_tokens} "
                f"{self.meta.dtype} tokens = {expected} bytes; the file is truncated or corrupt. "
                "Re-run `phalanx data prepare` to recreate it"
            )

    def _open_blocks(self) -> np.memmap:
        """A read-only ``(num_samples, block_size)`` view of the file; a remainder tail is ignored."""
        return np.memmap(
            self.bin_path,
            dtype=self.meta.numpy_dtype,
            mode="r",
            shape=(self.meta.num_samples, self.meta.block_size),
        )

    @property
    def block_size(self) -> int:
        return self.meta.block_size

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    def __len__(self) -> int:
        return self.meta.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """Sample `index` as an int64 array of ``block_size`` token ids."""
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples in {self.bin_path}")
        return self._blocks[index].astype(np.int64)

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Samples `indices` stacked as a ``torch.long`` tensor of shape ``[len(indices), block_size]``."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.ndim != 1:
            raise DataError(f"get_batch expects a 1-D sequence of sample indices, got shape {indices.shape}")
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            bad = indices[(indices < 0) | (indices >= len(self))][0]
            raise IndexError(f"sample index {bad} out of range for {len(self)} samples in {self.bin_path}")
        return torch.from_numpy(self._blocks[indices].astype(np.int64))

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise `DataError` if token ids may reach past the model's embedding table."""
        if self.meta.vocab_size > model_vocab_size:
            raise DataError(
                f"the data in {self.bin_path} was tokenized with vocab_size={self.meta.vocab_size}, but the model "
                f"has vocab_size={model_vocab_size}; token ids up to {self.meta.vocab_size - 1} would index past "
                "its embedding table. Use a model with vocab_size >= "
                f"{self.meta.vocab_size}, or re-run `phalanx data prepare` with a smaller tokenizer (--vocab-size)"
            )

    # np.memmap pickles as a full in-memory copy; ship only the path to DataLoader workers instead.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_blocks"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._blocks = self._open_blocks()

    def __repr__(self) -> str:
        m = self.meta
        return f"TokenDataset({str(self.bin_path)!r}, samples={m.num_samples}, block_size={m.block_size}, dtype={m.dtype})"
