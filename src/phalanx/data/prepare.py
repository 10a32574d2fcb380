"""Turn raw text files into fixed-size blocks of token ids on disk (``phalanx data prepare``).

Role: the offline step before training. It reads documents (`sources`), gets a tokenizer
(`tokenizer`: the given ``tokenizer.json`` or a freshly trained byte-level BPE), appends the EOS
token after every document, concatenates everything, cuts it into ``block_size`` samples and drops
the tail shorter than one block (the Hugging Face ``group_texts`` recipe), and writes
``train.bin``/``train.json`` (plus ``val.bin``/``val.json``) in the format of `token_file`.

Validation split: each document is assigned to ``val`` when a hash of ``(seed, document index)``
falls below ``val_percent`` percent, so the split is deterministic, needs no second pass, and train
and val never share a document. The document index counts non-empty documents across the inputs
in the order given. Blocks are cut per split, so no block mixes train and val text.

Everything streams: at most one encode batch of documents is in memory at a time. Files appear
in a safe order: the tokens and tokenizer under temporary names first, then moved into place, and
each split's metadata JSON last, so a token file without its metadata is never opened.

Must not know about: models, torch, the training loop, samplers, or how files are read at train time.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from tokenizers import Tokenizer

from phalanx.data.errors import DataError
from phalanx.data.sources import check_input_file, file_sha256, iter_documents
from phalanx.data.token_file import TokenFileMeta, TokenFileWriter, token_dtype_for_vocab, write_meta
from phalanx.data.tokenizer import find_eos_id, load_tokenizer, train_byte_level_bpe

TOKENIZER_FILENAME = "tokenizer.json"
MAX_VAL_PERCENT = 50.0
# The BPE trainer sees at most this many characters of training documents; more adds little.
BPE_TRAINING_MAX_CHARS = 256 * 2**20
# Draw a progress bar only when the inputs are at least this large.
PROGRESS_MIN_BYTES = 4 * 2**20
_ENCODE_BATCH_DOCS = 512
_ENCODE_BATCH_CHARS = 8 * 2**20


@dataclass(frozen=True)
class PreparedSplit:
    """One written split: its token file, metadata file and metadata."""

    split: str
    bin_path: Path
    meta_path: Path
    meta: TokenFileMeta
    num_documents: int


@dataclass(frozen=True)
class PreparedData:
    """What `prepare` wrote into `out_dir`."""

    out_dir: Path
    tokenizer_path: Path
    train: PreparedSplit
    val: PreparedSplit | None


def is_validation_document(doc_index: int, seed: int, val_percent: float) -> bool:
    """Deterministic, seed-dependent choice of ~`val_percent` % of documents for validation."""
    if val_percent <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{doc_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_percent / 100.0 * 2**64


def missing_directories(path: Path) -> Path | None:
    """The topmost directory that ``path.mkdir(parents=True)`` would create (None if `path` exists): what to
    remove, and only that, when a run that created it fails. Raises DataError when a file is in the way."""
    path = Path(path)
    created = None
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is an existing file" if candidate == path else f"is inside {candidate}, an existing file"
                raise DataError(f"--out {path} {where}; choose a directory for the prepared data")
            return created
        created = candidate
    return created


def remove_created(created: Path | None) -> None:
    """Undo `missing_directories`' directories after a failure (nothing when the output existed before)."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)


def prepare(
    inputs: list[Path],
    out_dir: Path,
    *,
    tokenizer: Path | None = None,
    block_size: int = 256,
    text_field: str = "text",
    val_percent: float = 0.0,
    vocab_size: int = 4096,
    seed: int = 0,
    eos_token: str | None = None,
    progress: bool = True,
) -> PreparedData:
    """Tokenize `inputs` into ``out_dir/{train,val}.{bin,json}`` plus ``out_dir/tokenizer.json``.

    `vocab_size` is the target size when training a BPE (ignored when `tokenizer` is given); the
    metadata records the tokenizer's actual size. `eos_token` overrides the EOS lookup. On failure the
    directories this call created are removed again; an existing `out_dir` keeps its earlier files.
    """
    created = missing_directories(Path(out_dir))
    try:
        return _prepare(inputs, out_dir, tokenizer=tokenizer, block_size=block_size, text_field=text_field,
                        val_percent=val_percent, vocab_size=vocab_size, seed=seed, eos_token=eos_token,
                        progress=progress)
    except BaseException:
        remove_created(created)
        raise


def _prepare(
    inputs: list[Path],
    out_dir: Path,
    *,
    tokenizer: Path | None,
    block_size: int,
    text_field: str,
    val_percent: float,
    vocab_size: int,
    seed: int,
    eos_token: str | None,
    progress: bool,
) -> PreparedData:
    inputs = [Path(p) for p in inputs]
    out_dir = Path(out_dir)
    _check_options(inputs, block_size, val_percent)
    out_dir.mkdir(parents=True, exist_ok=True)
    total_bytes = sum(p.stat().st_size for p in inputs)

    tokenizer_path = out_dir / TOKENIZER_FILENAME
    # Until the token files are complete, a new tokenizer waits under a temporary name, so a failed
    # run never leaves an earlier run's token files next to a tokenizer that did not make them.
    pending_tokenizer = tokenizer_path.with_name(TOKENIZER_FILENAME + ".tmp")
    try:
        with _progress_display(enabled=progress and total_bytes >= PROGRESS_MIN_BYTES) as display:
            if tokenizer is not None:
                tok = load_tokenizer(Path(tokenizer))
                shutil.copyfile(tokenizer, pending_tokenizer)
            else:
                task = display.add_task("training tokenizer", total=total_bytes)
                train_docs = (
                    doc
                    for index, doc in enumerate(_stream_documents(inputs, text_field, display, task))
                    if not is_validation_document(index, seed, val_percent)
                )
                tok = train_byte_level_bpe(_take_chars(train_docs, BPE_TRAINING_MAX_CHARS), vocab_size)
                tok.save(str(pending_tokenizer))
            eos_id = find_eos_id(tok, eos_token)
            task = display.add_task("tokenizing", total=total_bytes)
            splits = _write_splits(tok, inputs, out_dir, text_field, block_size, val_percent, seed, eos_id, display, task)
        os.replace(pending_tokenizer, tokenizer_path)
    finally:
        pending_tokenizer.unlink(missing_ok=True)

    tokenizer_sha256 = file_sha256(tokenizer_path)
    extra = {
        "source_files": [{"path": str(p.resolve()), "size": p.stat().st_size, "sha256": file_sha256(p)} for p in inputs],
        "tokenizer_file": TOKENIZER_FILENAME,
        "text_field": text_field,
        "val_percent": val_percent,
        "seed": seed,
    }
    actual_vocab_size = tok.get_vocab_size(with_added_tokens=True)
    written = {}
    for split, (bin_path, num_tokens, num_documents, dropped) in splits.items():
        meta = TokenFileMeta(
            vocab_size=actual_vocab_size,
            dtype=token_dtype_for_vocab(actual_vocab_size).name,
            block_size=block_size,
            num_samples=num_tokens // block_size,
            num_tokens=num_tokens,
            eos_id=eos_id,
            split=split,
            tokenizer_sha256=tokenizer_sha256,
        )
        meta_path = write_meta(bin_path, meta, {**extra, "num_documents": num_documents, "dropped_tail_tokens": dropped})
        written[split] = PreparedSplit(split, bin_path, meta_path, meta, num_documents)
    if "val" not in written:  # a validation split from an earlier run no longer matches
        for stale in (out_dir / "val.json", out_dir / "val.bin"):
            stale.unlink(missing_ok=True)
    return PreparedData(out_dir, tokenizer_path, written["train"], written.get("val"))


def _check_options(inputs: list[Path], block_size: int, val_percent: float) -> None:
    if not inputs:
        raise DataError("no input files given; pass one or more .txt/.jsonl/.parquet files (or --demo on the CLI)")
    for path in inputs:
        check_input_file(path)
    if block_size < 1:
        raise DataError(f"block_size={block_size} must be at least 1; use e.g. --block-size 256")
    if not 0.0 <= val_percent <= MAX_VAL_PERCENT:
        raise DataError(
            f"val_percent={val_percent} must be between 0 and {MAX_VAL_PERCENT:g}; e.g. --val-percent 1.0"
        )


def _write_splits(
    tok: Tokenizer,
    inputs: list[Path],
    out_dir: Path,
    text_field: str,
    block_size: int,
    val_percent: float,
    seed: int,
    eos_id: int,
    display: Progress,
    task: int,
) -> dict[str, tuple[Path, int, int, int]]:
    """Encode every document into its split's writer; returns split -> (path, tokens, docs, dropped)."""
    split_names = ["train", "val"] if val_percent > 0 else ["train"]
    dtype = token_dtype_for_vocab(tok.get_vocab_size(with_added_tokens=True))
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: faster, same ids
    with ExitStack() as stack:
        writers = {s: stack.enter_context(TokenFileWriter(out_dir / f"{s}.bin", dtype, block_size)) for s in split_names}
        pending: dict[str, list[str]] = {s: [] for s in split_names}
        pending_chars = dict.fromkeys(split_names, 0)
        num_documents = dict.fromkeys(split_names, 0)

        def flush(split: str) -> None:
            if pending[split]:
                encodings = encode(pending[split], add_special_tokens=False)
                writers[split].write(_concat_with_eos([e.ids for e in encodings], eos_id, dtype))
                pending[split], pending_chars[split] = [], 0

        for index, doc in enumerate(_stream_documents(inputs, text_field, display, task)):
            split = "val" if is_validation_document(index, seed, val_percent) else "train"
            pending[split].append(doc)
            pending_chars[split] += len(doc)
            num_documents[split] += 1
            if len(pending[split]) >= _ENCODE_BATCH_DOCS or pending_chars[split] >= _ENCODE_BATCH_CHARS:
                flush(split)
        for split in split_names:
            flush(split)

        if num_documents["train"] == 0:
            raise DataError(
                f"the inputs contain no training documents ({sum(num_documents.values())} documents in total, "
                f"text field {text_field!r}); check that the files are not empty"
                + (" or lower --val-percent" if val_percent > 0 else "")
            )
        for split, writer in writers.items():
            if writer.num_samples == 0:
                hint = " or raise --val-percent" if split == "val" else ""
                raise DataError(
                    f"the {split} split has only {writer.num_tokens_written} tokens from {num_documents[split]} "
                    f"documents, fewer than one block of block_size={block_size}; use a smaller --block-size{hint}"
                    " or more input text"
                )
        result = {}
        for split, writer in writers.items():
            kept = writer.finish()
            result[split] = (writer.path, kept, num_documents[split], writer.num_tokens_written - kept)
        return result


def _concat_with_eos(token_lists: list[list[int]], eos_id: int, dtype: np.dtype) -> np.ndarray:
    total = sum(len(ids) + 1 for ids in token_lists)
    flat = itertools.chain.from_iterable(itertools.chain(ids, (eos_id,)) for ids in token_lists)
    return np.fromiter(flat, dtype=dtype, count=total)


def _stream_documents(inputs: list[Path], text_field: str, display: Progress, task: int) -> Iterator[str]:
    """All documents of all inputs in order, advancing the progress task by bytes read."""
    bytes_before = 0
    for path in inputs:
        for doc, consumed in iter_documents(path, text_field):
            display.update(task, completed=bytes_before + consumed)
            yield doc
        bytes_before += path.stat().st_size
        display.update(task, completed=bytes_before)


def _take_chars(documents: Iterator[str], max_chars: int) -> Iterator[str]:
    taken = 0
    for doc in documents:
        if taken >= max_chars:
            return
        taken += len(doc)
        yield doc


def _progress_display(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
    )
