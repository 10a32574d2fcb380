"""Phalanx data layer: prepare token files offline, read them memory-mapped, order them per rank.

- `prepare` (``phalanx data prepare``): text/JSONL/Parquet -> ``train.bin``/``val.bin`` token blocks.
- `TokenDataset`: O(1) open, memory-mapped random access to those blocks.
- `GlobalBatchSampler`: the stateless global sample order; one integer (``samples_consumed``)
  is the whole position, so resume and data-parallel resizing are exact.
- `write_demo_corpus`: a small corpus bundled with Python itself, for first runs.

Must not know about: models, parallelism, torch.distributed, or the training loop.

`TokenDataset` (the only part that needs torch) is imported on first use, so `phalanx data prepare` and
the commands that only operate a cluster start without importing torch.
"""

from phalanx.data.corpus import write_demo_corpus
from phalanx.data.errors import DataError
from phalanx.data.prepare import PreparedData, PreparedSplit, is_validation_document, prepare
from phalanx.data.sampler import GlobalBatchSampler, IndexPermutation
from phalanx.data.token_file import FORMAT, TokenFileMeta, read_meta, token_dtype_for_vocab


def __getattr__(name: str):
    if name == "TokenDataset":  # imports torch: only when a dataset is actually opened
        from phalanx.data.dataset import TokenDataset

        return TokenDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT",
    "DataError",
    "GlobalBatchSampler",
    "IndexPermutation",
    "PreparedData",
    "PreparedSplit",
    "TokenDataset",
    "TokenFileMeta",
    "is_validation_document",
    "prepare",
    "read_meta",
    "token_dtype_for_vocab",
    "write_demo_corpus",
]
