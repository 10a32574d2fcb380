"""Tests for phalanx.data: prepare, token files, TokenDataset, GlobalBatchSampler, and the CLI."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from phalanx.data import (
    DataError,
    GlobalBatchSampler,
    IndexPermutation,
    TokenDataset,
    is_validation_document,
    prepare,
    read_meta,
    token_dtype_for_vocab,
    write_demo_corpus,
)
from phalanx.data.cli import data_app
from phalanx.data.sources import iter_documents
from phalanx.data.token_file import TokenFileMeta, write_meta

DEMO_VOCAB = 512
DEMO_BLOCK = 128


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo corpus prepared once with a freshly trained small BPE and a 10% validation split."""
    root = tmp_path_factory.mktemp("demo")
    corpus = write_demo_corpus(root / "corpus.jsonl")
    result = prepare([corpus], root / "out", block_size=DEMO_BLOCK, vocab_size=DEMO_VOCAB, val_percent=10, progress=False)
    return corpus, result


@pytest.fixture(scope="module")
def demo_tokenizer(demo) -> Path:
    return demo[1].tokenizer_path


def _docs(n: int) -> list[str]:
    """ASCII documents with a unique marker each and no blank lines inside."""
    return [f"document marker{i:04d} says hello to the tokenizer.\nsecond line of doc {i}." for i in range(n)]


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    # Small row groups so the reader really streams several of them.
    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path, row_group_size=7)
    return path


def _write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n\n".join(docs) + "\n")
    return path


# --------------------------------------------------------------------------- prepare


def test_demo_prepare_writes_consistent_metadata_and_tokens(demo):
    corpus, result = demo
    meta_record = json.loads(result.train.meta_path.read_text())
    assert meta_record["format"] == "phalanx-tokens-v1"
    assert meta_record["split"] == "train"
    assert meta_record["dtype"] == "uint16"
    assert meta_record["block_size"] == DEMO_BLOCK
    assert meta_record["vocab_size"] == DEMO_VOCAB
    assert meta_record["num_tokens"] == meta_record["num_samples"] * DEMO_BLOCK
    assert meta_record["num_samples"] > 100
    assert meta_record["source_files"][0]["path"] == str(corpus.resolve())
    assert meta_record["source_files"][0]["size"] == corpus.stat().st_size
    assert len(meta_record["source_files"][0]["sha256"]) == 64

    tok = Tokenizer.from_file(str(result.tokenizer_path))
    assert tok.token_to_id("<|endoftext|>") == meta_record["eos_id"]
    assert meta_record["tokenizer_sha256"] == hashlib.sha256(result.tokenizer_path.read_bytes()).hexdigest()

    tokens = np.fromfile(result.train.bin_path, dtype="<u2")
    assert result.train.bin_path.stat().st_size == meta_record["num_tokens"] * 2
    assert tokens.size == meta_record["num_tokens"]
    assert tokens.max() < DEMO_VOCAB
    # One EOS per document, except EOS tokens that fell into the dropped tail.
    eos_count = int((tokens == meta_record["eos_id"]).sum())
    docs = meta_record["num_documents"]
    assert docs - meta_record["dropped_tail_tokens"] <= eos_count <= docs
    assert not list(result.out_dir.glob("*.tmp"))


def test_demo_corpus_is_deterministic_and_first_block_decodes_to_first_topic(demo, tmp_path):
    corpus, result = demo
    again = write_demo_corpus(tmp_path / "again.jsonl")
    assert again.read_bytes() == corpus.read_bytes()
    first_doc = json.loads(corpus.read_text().splitlines()[0])["text"]
    assert not is_validation_document(0, seed=0, val_percent=10)  # so the first train doc is doc 0
    tok = Tokenizer.from_file(str(result.tokenizer_path))
    first_block = TokenDataset(result.out_dir)[0]
    assert first_doc.startswith(tok.decode(first_block.tolist(), skip_special_tokens=False)[:200])


def test_jsonl_parquet_and_txt_inputs_give_identical_tokens(tmp_path, demo_tokenizer):
    docs = _docs(40)
    inputs = {
        "jsonl": _write_jsonl(tmp_path / "c.jsonl", docs),
        "parquet": _write_parquet(tmp_path / "c.parquet", docs),
        "txt": _write_txt(tmp_path / "c.txt", docs),
    }
    token_files = {}
    for name, path in inputs.items():
        result = prepare([path], tmp_path / name, tokenizer=demo_tokenizer, block_size=16, progress=False)
        assert result.train.num_documents == 40
        token_files[name] = result.train.bin_path.read_bytes()
    assert token_files["jsonl"] == token_files["parquet"] == token_files["txt"]


def test_txt_documents_are_blank_line_separated_paragraphs(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("\n\nfirst para\nstill first\n\n \n\t\nsecond para\n\n\n\nthird\n")
    docs = [doc for doc, _ in iter_documents(path)]
    assert docs == ["first para\nstill first", "second para", "third"]
    _, consumed = list(iter_documents(path))[-1]
    assert consumed == path.stat().st_size


def test_multiple_inputs_are_concatenated_in_order(tmp_path, demo_tokenizer):
    docs = _docs(20)
    a = _write_jsonl(tmp_path / "a.jsonl", docs[:10])
    b = _write_parquet(tmp_path / "b.parquet", docs[10:])
    both = prepare([a, b], tmp_path / "both", tokenizer=demo_tokenizer, block_size=8, progress=False)
    single = prepare([_write_jsonl(tmp_path / "all.jsonl", docs)], tmp_path / "single", tokenizer=demo_tokenizer, block_size=8, progress=False)
    assert both.train.bin_path.read_bytes() == single.train.bin_path.read_bytes()
    assert len(json.loads(both.train.meta_path.read_text())["source_files"]) == 2


def test_given_tokenizer_is_copied_and_used(tmp_path, demo_tokenizer):
    docs = _docs(5)
    result = prepare([_write_jsonl(tmp_path / "c.jsonl", docs)], tmp_path / "out", tokenizer=demo_tokenizer, block_size=4, progress=False)
    assert result.tokenizer_path == tmp_path / "out" / "tokenizer.json"
    assert result.tokenizer_path.read_bytes() == demo_tokenizer.read_bytes()
    tok = Tokenizer.from_file(str(demo_tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    expected = []
    for doc in docs:
        expected += tok.encode(doc, add_special_tokens=False).ids + [eos]
    kept = len(expected) // 4 * 4
    assert np.fromfile(result.train.bin_path, dtype="<u2").tolist() == expected[:kept]
    assert result.train.meta.vocab_size == tok.get_vocab_size()


def test_token_dtype_is_uint16_up_to_65536_ids_then_uint32():
    assert token_dtype_for_vocab(512) == np.dtype("<u2")
    assert token_dtype_for_vocab(65536) == np.dtype("<u2")
    assert token_dtype_for_vocab(65537) == np.dtype("<u4")
    assert token_dtype_for_vocab(150_000) == np.dtype("<u4")


def test_uint32_token_file_round_trips_through_dataset(tmp_path):
    tokens = np.arange(100_000, 100_000 + 3 * 8, dtype="<u4")
    tokens.tofile(tmp_path / "train.bin")
    write_meta(tmp_path / "train.bin", TokenFileMeta(vocab_size=200_000, dtype="uint32", block_size=8, num_samples=3, num_tokens=24, eos_id=0), {})
    ds = TokenDataset(tmp_path)
    assert ds.get_batch([2, 0]).tolist() == [tokens[16:24].tolist(), tokens[0:8].tolist()]


def test_validation_split_holds_whole_documents_disjoint_from_train(tmp_path, demo_tokenizer):
    docs = _docs(200)
    corpus = _write_jsonl(tmp_path / "c.jsonl", docs)
    result = prepare([corpus], tmp_path / "out", tokenizer=demo_tokenizer, block_size=8, val_percent=20, seed=7, progress=False)
    tok = Tokenizer.from_file(str(demo_tokenizer))
    text = {s: tok.decode(np.fromfile(getattr(result, s).bin_path, dtype="<u2").tolist()) for s in ("train", "val")}
    expected_val = {i for i in range(200) if is_validation_document(i, seed=7, val_percent=20)}
    assert 20 <= len(expected_val) <= 60
    assert result.val.num_documents == len(expected_val)
    assert result.train.num_documents == 200 - len(expected_val)
    for i in range(200):
        marker = f"marker{i:04d}"
        assert marker not in text["train" if i in expected_val else "val"]
    # Most markers survive (only a dropped tail can lose the last document of a split).
    assert sum(f"marker{i:04d}" in text["val"] for i in expected_val) >= len(expected_val) - 1
    # Same seed: same split. Another seed: another split.
    again = prepare([corpus], tmp_path / "again", tokenizer=demo_tokenizer, block_size=8, val_percent=20, seed=7, progress=False)
    assert again.val.bin_path.read_bytes() == result.val.bin_path.read_bytes()
    assert {i for i in range(200) if is_validation_document(i, seed=8, val_percent=20)} != expected_val
    # Re-preparing without a validation split removes the stale one.
    assert prepare([corpus], tmp_path / "out", tokenizer=demo_tokenizer, block_size=8, progress=False).val is None
    assert not (tmp_path / "out" / "val.bin").exists() and not (tmp_path / "out" / "val.json").exists()


# --------------------------------------------------------------------------- prepare errors


def _prepare_error(*args, **kwargs) -> str:
    kwargs.setdefault("progress", False)
    with pytest.raises(DataError) as info:
        prepare(*args, **kwargs)
    return str(info.value)


def test_missing_input_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert str(missing) in _prepare_error([missing], tmp_path / "out")


def test_unsupported_file_type_is_rejected(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    message = _prepare_error([path], tmp_path / "out")
    assert "'.csv'" in message and ".jsonl" in message and ".parquet" in message


def test_missing_jsonl_text_field_names_field_and_present_fields(tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _docs(3), field="body")
    message = _prepare_error([path], tmp_path / "out", vocab_size=300)
    assert "'text'" in message and "'body'" in message and "'id'" in message and "--text-field" in message


def test_missing_parquet_column_names_field_and_present_columns(tmp_path, demo_tokenizer):
    path = _write_parquet(tmp_path / "c.parquet", _docs(3), field="content")
    message = _prepare_error([path], tmp_path / "out", tokenizer=demo_tokenizer)
    assert "'text'" in message and "content" in message and "--text-field" in message
    assert prepare([path], tmp_path / "ok", tokenizer=demo_tokenizer, text_field="content", block_size=4, progress=False).train.num_documents == 3


def test_empty_corpus_is_rejected(tmp_path, demo_tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert "no training documents" in _prepare_error([path], tmp_path / "out", tokenizer=demo_tokenizer)


def test_too_few_tokens_for_one_block_reports_count_and_leaves_no_files(tmp_path, demo_tokenizer):
    path = _write_jsonl(tmp_path / "c.jsonl", ["tiny"])
    out = tmp_path / "out"
    message = _prepare_error([path], out, tokenizer=demo_tokenizer, block_size=4096)
    assert "block_size=4096" in message and "smaller --block-size" in message
    num_tokens = len(Tokenizer.from_file(str(demo_tokenizer)).encode("tiny").ids) + 1
    assert f"only {num_tokens} tokens" in message
    assert not list(out.glob("*.bin*"))


def test_failed_prepare_keeps_previous_outputs(tmp_path):
    out = tmp_path / "out"
    good = prepare([_write_jsonl(tmp_path / "c.jsonl", _docs(10))], out, vocab_size=300, block_size=8, progress=False)
    tokens_before, tokenizer_before = good.train.bin_path.read_bytes(), good.tokenizer_path.read_bytes()
    _prepare_error([_write_jsonl(tmp_path / "small.jsonl", ["x"])], out, vocab_size=300, block_size=8)
    assert good.train.bin_path.read_bytes() == tokens_before
    assert good.tokenizer_path.read_bytes() == tokenizer_before
    assert TokenDataset(out).meta == good.train.meta
    assert not list(out.glob("*.tmp"))


def test_bad_options_name_the_option(tmp_path, demo_tokenizer):
    path = _write_jsonl(tmp_path / "c.jsonl", _docs(3))
    assert "val_percent=75" in _prepare_error([path], tmp_path / "o", val_percent=75)
    assert "block_size=0" in _prepare_error([path], tmp_path / "o", block_size=0)
    assert "--vocab-size" in _prepare_error([path], tmp_path / "o", vocab_size=100)
    assert "--eos-token" in _prepare_error([path], tmp_path / "o", tokenizer=demo_tokenizer, eos_token="<nope>")
    assert "no input files" in _prepare_error([], tmp_path / "o")


def test_tokenizer_without_eos_asks_for_eos_token(tmp_path):
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[END]": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_path = tmp_path / "wordlevel.json"
    tok.save(str(tok_path))
    corpus = _write_jsonl(tmp_path / "c.jsonl", ["hello world"] * 4)
    message = _prepare_error([corpus], tmp_path / "o", tokenizer=tok_path)
    assert "--eos-token" in message and "</s>" in message
    result = prepare([corpus], tmp_path / "o", tokenizer=tok_path, eos_token="[END]", block_size=3, progress=False)
    assert np.fromfile(result.train.bin_path, dtype="<u2").tolist() == [0, 1, 2] * 4
    assert result.train.meta.eos_id == 2


# --------------------------------------------------------------------------- TokenDataset


def test_dataset_reads_blocks_and_batches(demo):
    _, result = demo
    ds = TokenDataset(result.out_dir)
    raw = np.fromfile(result.train.bin_path, dtype="<u2").reshape(-1, DEMO_BLOCK)
    assert len(ds) == result.train.meta.num_samples == raw.shape[0]
    assert ds[3].dtype == np.int64 and ds[3].tolist() == raw[3].tolist()
    assert ds[-1].tolist() == raw[-1].tolist()
    batch = ds.get_batch([5, 0, 5, len(ds) - 1])
    assert batch.dtype == torch.long and batch.shape == (4, DEMO_BLOCK)
    assert batch.tolist() == raw[[5, 0, 5, len(ds) - 1]].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.get_batch([0, len(ds)])
    # Opening the .bin directly is the same as opening the directory.
    assert TokenDataset(result.train.bin_path).meta == ds.meta
    val = TokenDataset(result.out_dir, split="val")
    assert val.meta.split == "val" and len(val) == result.val.meta.num_samples


def test_dataset_pickles_without_copying_tokens(demo):
    ds = TokenDataset(demo[1].out_dir)
    payload = pickle.dumps(ds)
    assert len(payload) < 2048
    assert pickle.loads(payload).get_batch([1, 2]).tolist() == ds.get_batch([1, 2]).tolist()


def test_dataset_missing_split_or_metadata_is_reported(tmp_path, demo):
    with pytest.raises(DataError, match="phalanx data prepare"):
        TokenDataset(tmp_path, split="train")
    copy = tmp_path / "copy"
    shutil.copytree(demo[1].out_dir, copy)
    (copy / "train.json").unlink()
    with pytest.raises(DataError, match="metadata file .*train.json.* is missing"):
        TokenDataset(copy)


def test_truncated_token_file_is_detected(tmp_path, demo):
    copy = tmp_path / "copy"
    shutil.copytree(demo[1].out_dir, copy)
    bin_path = copy / "train.bin"
    with open(bin_path, "r+b") as f:
        f.truncate(bin_path.stat().st_size - 2)
    with pytest.raises(DataError) as info:
        TokenDataset(copy)
    assert "truncated or corrupt" in str(info.value) and "phalanx data prepare" in str(info.value)


def test_check_vocab_names_both_sizes(demo):
    ds = TokenDataset(demo[1].out_dir)
    ds.check_vocab(DEMO_VOCAB)
    ds.check_vocab(50_000)
    with pytest.raises(DataError) as info:
        ds.check_vocab(256)
    message = str(info.value)
    assert f"vocab_size={DEMO_VOCAB}" in message and "vocab_size=256" in message and "smaller tokenizer" in message


def test_dataset_open_does_not_read_the_token_file(tmp_path):
    # A 2 GiB sparse file: opening and reading one batch must not touch the rest.
    block_size, num_samples = 1024, 2**20
    bin_path = tmp_path / "train.bin"
    with open(bin_path, "wb") as f:
        f.truncate(block_size * num_samples * 2)
    write_meta(bin_path, TokenFileMeta(vocab_size=512, dtype="uint16", block_size=block_size, num_samples=num_samples, num_tokens=block_size * num_samples, eos_id=0), {})
    start = time.perf_counter()
    ds = TokenDataset(tmp_path)
    batch = ds.get_batch([0, num_samples - 1, 12345])
    assert time.perf_counter() - start < 0.5
    assert len(ds) == num_samples and batch.shape == (3, block_size) and int(batch.sum()) == 0
    assert read_meta(bin_path).num_samples == num_samples


# --------------------------------------------------------------------------- GlobalBatchSampler


@pytest.mark.parametrize("n", [1, 2, 3, 10, 17, 64, 1000, 4099])
def test_each_epoch_is_a_permutation(n):
    sampler = GlobalBatchSampler(n, global_batch_size=n, seed=5)
    orders = [sampler.global_batch(epoch * n) for epoch in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(n))
    if n >= 10:
        assert orders[0].tolist() != list(range(n))  # actually shuffled
        assert orders[0].tolist() != orders[1].tolist()  # reshuffled per epoch


def test_batches_straddling_epoch_boundaries_neither_skip_nor_repeat():
    n, gb = 10, 4
    sampler = GlobalBatchSampler(n, gb, seed=1)
    stream = np.concatenate([sampler.global_batch(k) for k in range(0, 40, gb)])
    for epoch in range(4):
        assert sorted(stream[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    assert stream[n : 2 * n].tolist() == GlobalBatchSampler(n, n, seed=1).global_batch(n).tolist()
    # A global batch larger than the dataset spans several whole epochs.
    big = GlobalBatchSampler(3, 9, seed=0).global_batch(0)
    assert [sorted(big[i : i + 3].tolist()) for i in (0, 3, 6)] == [[0, 1, 2]] * 3


def test_union_of_local_batches_is_the_global_batch():
    n, gb, position = 1001, 48, 960
    reference = GlobalBatchSampler(n, gb, seed=3).global_batch(position)
    for dp_size in (1, 2, 3, 4, 8, 16):
        locals_ = [GlobalBatchSampler(n, gb, seed=3, dp_rank=r, dp_size=dp_size).local_batch(position) for r in range(dp_size)]
        assert all(len(b) == gb // dp_size for b in locals_)
        assert np.concatenate(locals_).tolist() == reference.tolist()


def test_resume_and_resize_continue_the_same_global_sequence():
    n, gb = 500, 32
    steps = [GlobalBatchSampler(n, gb, seed=11).global_batch(k * gb) for k in range(40)]
    resume_at = 17 * gb
    resumed = GlobalBatchSampler(n, gb, seed=11)
    assert [resumed.global_batch(resume_at + k * gb).tolist() for k in range(23)] == [s.tolist() for s in steps[17:]]
    # 4 ranks until step 17, then 2 ranks: the global sequence is unchanged.
    for k in range(40):
        dp_size = 4 if k < 17 else 2
        ranks = [GlobalBatchSampler(n, gb, seed=11, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
        assert np.concatenate([s.local_batch(k * gb) for s in ranks]).tolist() == steps[k].tolist()


def test_local_micro_batches_split_the_local_batch():
    sampler = GlobalBatchSampler(100, 24, seed=0, dp_rank=1, dp_size=2)
    micro = sampler.local_micro_batches(50, micro_batch_size=4)
    assert len(micro) == 3 and all(len(m) == 4 for m in micro)
    assert np.concatenate(micro).tolist() == sampler.local_batch(50).tolist()
    with pytest.raises(DataError, match="micro_batch_size=5"):
        sampler.local_micro_batches(0, micro_batch_size=5)


def test_seed_changes_the_order():
    a = GlobalBatchSampler(1000, 64, seed=0).global_batch(0)
    b = GlobalBatchSampler(1000, 64, seed=1).global_batch(0)
    assert a.tolist() != b.tolist()


def test_sampler_is_constant_time_for_huge_datasets():
    start = time.perf_counter()
    sampler = GlobalBatchSampler(10**12, 1024, seed=2, dp_rank=3, dp_size=8)
    batch = sampler.global_batch(10**15 + 123)
    local = sampler.local_batch(10**15 + 123)
    assert time.perf_counter() - start < 0.5
    assert batch.min() >= 0 and batch.max() < 10**12 and len(set(batch.tolist())) == 1024
    assert local.tolist() == batch[3 * 128 : 4 * 128].tolist()
    assert sampler.epoch(10**15 + 123) == 1000
    # The permutation is a bijection computed per index: spot-check it against a dense inverse.
    perm = IndexPermutation(5000, key="k")
    assert sorted(perm(np.arange(5000)).tolist()) == list(range(5000))


def test_sampler_rejects_bad_settings_with_the_fix():
    with pytest.raises(DataError, match="global_batch_size=10 is not divisible by dp_size=4"):
        GlobalBatchSampler(100, 10, seed=0, dp_rank=0, dp_size=4)
    with pytest.raises(DataError, match="dp_rank=4 must be less than dp_size=4"):
        GlobalBatchSampler(100, 8, seed=0, dp_rank=4, dp_size=4)
    with pytest.raises(DataError, match="num_samples=0"):
        GlobalBatchSampler(0, 8, seed=0)
    with pytest.raises(DataError, match="samples_consumed=-1"):
        GlobalBatchSampler(10, 2, seed=0).global_batch(-1)


# --------------------------------------------------------------------------- CLI


def test_cli_prepare_demo(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        data_app, ["prepare", "--demo", "--out", str(out), "--vocab-size", "300", "--block-size", "64", "--val-percent", "5"]
    )
    assert result.exit_code == 0, result.output
    assert "samples" in result.output and "train" in result.output and "val" in result.output
    ds = TokenDataset(out)
    assert ds.meta.vocab_size == 300 and ds.meta.block_size == 64 and len(ds) > 0
    assert (out / "tokenizer.json").is_file() and (out / "val.bin").is_file()


def test_cli_data_error_exits_2_with_message_and_no_traceback(tmp_path):
    missing = tmp_path / "missing.jsonl"
    result = CliRunner().invoke(data_app, ["prepare", str(missing), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "missing.jsonl" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(data_app, ["prepare", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--demo" in result.output
