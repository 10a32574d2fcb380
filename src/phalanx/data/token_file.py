"""The on-disk token format: ``<split>.bin`` (raw tokens) next to ``<split>.json`` (metadata).

Role: define format ``phalanx-tokens-v1`` in one place, for both the writer (`prepare`) and the
reader (`TokenDataset`):

- ``<split>.bin`` is a headerless little-endian numpy array of token ids, ``uint16`` when the
  vocabulary fits (<= 65536 ids) else ``uint32``. It holds exactly ``num_tokens`` =
  ``num_samples * block_size`` tokens: sample ``i`` is tokens ``[i*block_size, (i+1)*block_size)``.
- ``<split>.json`` holds `TokenFileMeta` plus provenance (tokenizer hash, source files).

Both files are written under a temporary name and moved into place with `os.replace`, so a crash
never leaves a half-written file under the real name.

Must not know about: text formats, tokenizers, datasets, samplers, torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.data.errors import DataError

FORMAT = "phalanx-tokens-v1"
SUPPORTED_DTYPES = ("uint16", "uint32")
_UINT16_MAX_VOCAB = 1 << 16


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Little-endian ``uint16`` when every id < `vocab_size` fits in 16 bits, else ``uint32``."""
    if vocab_size < 1:
        raise DataError(f"vocab_size={vocab_size} must be at least 1")
    if vocab_size <= _UINT16_MAX_VOCAB:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise DataError(f"vocab_size={vocab_size} does not fit in uint32 token ids; use a tokenizer with at most 2**32 tokens")


@dataclass(frozen=True)
class TokenFileMeta:
    """What a reader needs to interpret a ``.bin`` token file."""

    vocab_size: int
    dtype: str  # "uint16" or "uint32", always little-endian
    block_size: int
    num_samples: int
    num_tokens: int
    eos_id: int
    split: str = "train"
    tokenizer_sha256: str = ""

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<")

    @property
    def expected_file_bytes(self) -> int:
        return self.num_tokens * self.numpy_dtype.itemsize


def meta_path_for(bin_path: Path) -> Path:
    """``train.bin`` -> ``train.json``."""
    return bin_path.with_suffix(".json")


def write_meta(bin_path: Path, meta: TokenFileMeta, extra: dict[str, Any]) -> Path:
    """Atomically write the metadata JSON for `bin_path`; `extra` adds provenance fields."""
    record = {"format": FORMAT, **asdict(meta), **extra}
    path = meta_path_for(bin_path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_meta(bin_path: Path) -> TokenFileMeta:
    """Read and validate the metadata JSON that belongs to `bin_path`."""
    path = meta_path_for(bin_path)
    rerun = "re-run `phalanx data prepare` to recreate it"
    if not path.is_file():
        raise DataError(f"metadata file {path} for token file {bin_path} is missing; {rerun}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"metadata file {path} is not valid JSON ({e}); {rerun}") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise DataError(f"metadata file {path} has format {found!r}, expected {FORMAT!r}; {rerun}")
    values = {}
    for field in fields(TokenFileMeta):
        if field.name not in record:
            if field.name in ("split", "tokenizer_sha256"):
                continue
            raise DataError(f"metadata file {path} lacks the field {field.name!r}; {rerun}")
        values[field.name] = record[field.name]
    meta = TokenFileMeta(**values)
    _validate_meta(meta, path, rerun)
    return meta


def _validate_meta(meta: TokenFileMeta, path: Path, rerun: str) -> None:
    for name in ("vocab_size", "block_size", "num_samples", "num_tokens", "eos_id"):
        value = getattr(meta, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DataError(f"metadata file {path}: {name}={value!r} must be a non-negative integer; {rerun}")
    if meta.dtype not in SUPPORTED_DTYPES:
        raise DataError(f"metadata file {path}: dtype={meta.dtype!r} must be one of {SUPPORTED_DTYPES}; {rerun}")
    if meta.block_size < 1 or meta.num_samples < 1:
        raise DataError(
            f"metadata file {path}: block_size={meta.block_size} and num_samples={meta.num_samples} must both be >= 1; {rerun}"
        )
    if meta.num_tokens < meta.num_samples * meta.block_size:
        raise DataError(
            f"metadata file {path}: num_tokens={meta.num_tokens} is less than num_samples*block_size="
            f"{meta.num_samples * meta.block_size}; {rerun}"
        )


class TokenFileWriter:
    """Append token ids to ``<path>.tmp``; `finish` trims to whole blocks and moves it to `path`.

    Use as a context manager: leaving the block with an exception deletes the temporary file and
    leaves any existing file at `path` untouched.
    """

    def __init__(self, path: Path, dtype: np.dtype, block_size: int) -> None:
        self.path = path
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.block_size = block_size
        self.num_tokens_written = 0
        self._tmp_path = path.with_name(path.name + ".tmp")
        self._file = open(self._tmp_path, "wb")

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def write(self, token_ids: np.ndarray) -> None:
        token_ids.astype(self.dtype, copy=False).tofile(self._file)
        self.num_tokens_written += len(token_ids)

    @property
    def num_samples(self) -> int:
        return self.num_tokens_written // self.block_size

    def finish(self) -> int:
        """Drop the tail shorter than one block, move the file into place; returns tokens kept."""
        kept = self.num_samples * self.block_size
        self._file.truncate(kept * self.dtype.itemsize)
        self._file.close()
        # A stale metadata file from an earlier run must never describe the new token file.
        meta_path_for(self.path).unlink(missing_ok=True)
        os.replace(self._tmp_path, self.path)
        return kept

    def abort(self) -> None:
        self._file.close()
        self._tmp_path.unlink(missing_ok=True)
