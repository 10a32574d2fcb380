"""``phalanx data ...`` commands: a thin typer front end over `phalanx.data.prepare`.

Role: parse options, call the Python API, print a short summary. A `DataError` is printed as one
red line and exits with code 2, without a traceback. A failed run removes what it created (the `--out`
directory if it made it, or the demo corpus it wrote into an existing one), nothing else. The top-level
CLI mounts this app with ``app.add_typer(data_app, name="data")``.

Must not know about: how preparation works, models, or training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from phalanx.data.corpus import DEMO_CORPUS_FILENAME, write_demo_corpus
from phalanx.data.errors import DataError
from phalanx.data.prepare import PreparedData, missing_directories, prepare, remove_created

DATA_ERROR_EXIT_CODE = 2

data_app = typer.Typer(help="Prepare token datasets: text/JSONL/Parquet in, memory-mapped token blocks out.")


@data_app.callback()
def _data_group() -> None:
    """Prepare token datasets for training."""  # a callback keeps `prepare` a subcommand


@data_app.command("prepare")
def prepare_command(
    inputs: Optional[list[Path]] = typer.Argument(
        None, help="Input files: .txt (blank-line separated paragraphs), .jsonl/.ndjson, .parquet.", show_default=False
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory for train/val .bin+.json and tokenizer.json."),
    tokenizer: Optional[Path] = typer.Option(
        None, "--tokenizer", help="Hugging Face tokenizer.json to use; default: train a byte-level BPE on the inputs."
    ),
    block_size: int = typer.Option(256, "--block-size", help="Tokens per training sample."),
    text_field: str = typer.Option("text", "--text-field", help="JSONL key / Parquet column holding the text."),
    val_percent: float = typer.Option(0.0, "--val-percent", help="Percent of documents (0-50) held out for validation."),
    vocab_size: int = typer.Option(4096, "--vocab-size", help="Vocabulary size of the trained BPE (ignored with --tokenizer)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the train/validation document split."),
    eos_token: Optional[str] = typer.Option(
        None, "--eos-token", help="End-of-document token; default: the first of <|endoftext|>, </s>, <eos>, <|end_of_text|>."
    ),
    demo: bool = typer.Option(False, "--demo", help="Use the bundled demo corpus (Python's help topics) as input."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar for large inputs."),
) -> None:
    """Tokenize INPUT files into fixed-size blocks for training."""
    console = Console()
    demo_corpus = out / DEMO_CORPUS_FILENAME
    new_demo_corpus = demo and not demo_corpus.exists()
    created = None
    try:
        created = missing_directories(out)  # on failure, remove only what this run created
        if demo and inputs:
            raise DataError("pass either input files or --demo, not both")
        if demo:
            inputs = [write_demo_corpus(out / DEMO_CORPUS_FILENAME)]
        if not inputs:
            raise DataError("no input files given; pass one or more .txt/.jsonl/.parquet files, or --demo")
        result = prepare(
            inputs,
            out,
            tokenizer=tokenizer,
            block_size=block_size,
            text_field=text_field,
            val_percent=val_percent,
            vocab_size=vocab_size,
            seed=seed,
            eos_token=eos_token,
            progress=progress,
        )
    except BaseException as e:
        remove_created(created)
        if created is None and new_demo_corpus and demo_corpus.is_file():
            demo_corpus.unlink()
        if not isinstance(e, DataError):
            raise
        Console(stderr=True).print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(DATA_ERROR_EXIT_CODE) from None
    console.print(_summary_table(result))


def _summary_table(result: PreparedData) -> Table:
    train_meta = result.train.meta
    table = Table(
        title=f"prepared {result.out_dir}  (vocab {train_meta.vocab_size}, {train_meta.dtype}, "
        f"block {train_meta.block_size}, eos id {train_meta.eos_id})"
    )
    for column in ("split", "documents", "samples", "tokens", "file"):
        table.add_column(column, justify="right" if column in ("documents", "samples", "tokens") else "left")
    for split in (result.train, result.val):
        if split is not None:
            table.add_row(
                split.split, f"{split.num_documents:,}", f"{split.meta.num_samples:,}", f"{split.meta.num_tokens:,}", str(split.bin_path)
            )
    table.caption = f"tokenizer: {result.tokenizer_path}"
    return table
