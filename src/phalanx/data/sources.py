"""Read documents (plain strings) out of raw text corpora, streaming.

Role: turn one input file into an iterator of documents, never holding the whole file in memory.
Supported formats, chosen by file extension:

- ``.txt``: UTF-8 text; documents are *paragraphs* separated by one or more blank lines. We split
  instead of treating the file as one document so that a single large file (a book, a scraped
  dump) streams line by line and can still be divided into train and validation documents.
  Line breaks inside a paragraph are kept.
- ``.jsonl`` / ``.ndjson``: one JSON object per line; the document is the ``text_field`` value.
- ``.parquet``: the ``text_field`` column, read one record batch at a time with pyarrow.

Empty (or whitespace-only) documents and null values are skipped everywhere.

Each document is yielded together with the number of bytes of its file consumed so far, so that a
caller can draw a byte-based progress bar without knowing the format.

Must not know about: tokenizers, token files, splits, or progress display.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from phalanx.data.errors import DataError

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES

_PARQUET_BATCH_ROWS = 1024
_HASH_CHUNK_BYTES = 1 << 20


def check_input_file(path: Path) -> None:
    """Raise `DataError` if `path` does not exist, is not a file, or has an unsupported suffix."""
    if not path.exists():
        raise DataError(f"input file not found: {path} (check the path; inputs must be existing files)")
    if not path.is_file():
        raise DataError(f"input is not a regular file: {path} (pass files, not directories)")
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise DataError(
            f"unsupported input file type {path.suffix or '(no extension)'!r} for {path}; "
            f"supported extensions: {', '.join(SUPPORTED_SUFFIXES)} "
            "(convert the file or rename it if it already has one of these formats)"
        )


def iter_documents(path: Path, text_field: str = "text") -> Iterator[tuple[str, int]]:
    """Yield ``(document, bytes_of_file_consumed)`` for every non-empty document in `path`."""
    check_input_file(path)
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield from _iter_text_paragraphs(path)
    elif suffix in JSONL_SUFFIXES:
        yield from _iter_jsonl(path, text_field)
    else:
        yield from _iter_parquet(path, text_field)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of the file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _decode(raw: bytes, path: Path, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: {where} is not valid UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8") from e


def _iter_text_paragraphs(path: Path) -> Iterator[tuple[str, int]]:
    paragraph: list[bytes] = []
    consumed = 0
    line_number = 0
    with open(path, "rb") as f:
        for line in f:
            line_number += 1
            consumed += len(line)
            if line.strip():
                paragraph.append(line)
                continue
            if paragraph:
                yield _decode(b"".join(paragraph), path, f"paragraph ending at line {line_number}").rstrip("\r\n"), consumed
                paragraph = []
    if paragraph:
        yield _decode(b"".join(paragraph), path, f"paragraph ending at line {line_number}").rstrip("\r\n"), consumed


def _iter_jsonl(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    consumed = 0
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            consumed += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {line_number}: invalid JSON ({e.msg}); each line must be one JSON object") from e
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}, line {line_number}: expected a JSON object, got {type(record).__name__}; "
                    "each line must be an object like {\"text\": \"...\"}"
                )
            if text_field not in record:
                raise DataError(
                    f"{path}, line {line_number}: text field {text_field!r} not found; fields present: "
                    f"{sorted(record)}. Pick the field holding the text with --text-field (text_field=...)"
                )
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"{path}, line {line_number}: field {text_field!r} holds a {type(text).__name__}, not a string; "
                    "choose a text field with --text-field (text_field=...)"
                )
            if text.strip():
                yield text, consumed


def _iter_parquet(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    import pyarrow.parquet as pq

    try:
        parquet_file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise DataError(f"{path}: cannot read as Parquet ({e}); check that the file is a valid Parquet file") from e
    columns = parquet_file.schema_arrow.names
    if text_field not in columns:
        raise DataError(
            f"{path}: text field {text_field!r} not found; columns present: {columns}. "
            "Pick the column holding the text with --text-field (text_field=...)"
        )
    file_size = path.stat().st_size
    total_rows = max(parquet_file.metadata.num_rows, 1)
    rows_read = 0
    for batch in parquet_file.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
        values = batch.column(0).to_pylist()
        rows_read += len(values)
        consumed = file_size * rows_read // total_rows
        for text in values:
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"{path}: column {text_field!r} holds {type(text).__name__} values, not strings; "
                    "choose a text column with --text-field (text_field=...)"
                )
            if text.strip():
                yield text, consumed
