"""Obtain the Hugging Face `tokenizers` tokenizer used to prepare a corpus.

Role: load a given ``tokenizer.json``, or train a small byte-level BPE on the corpus when none is
given, and find the end-of-sequence token id. Byte-level BPE can encode any UTF-8 text, so a
trained tokenizer never produces unknown tokens.

Must not know about: where documents come from, token files, splits, or training.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from phalanx.data.errors import DataError

ENDOFTEXT = "<|endoftext|>"
# Tried in this order when the user does not name the EOS token.
EOS_CANDIDATES = (ENDOFTEXT, "</s>", "<eos>", "<|end_of_text|>")
# 256 byte symbols plus the <|endoftext|> special token.
MIN_BPE_VOCAB_SIZE = 257


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a Hugging Face ``tokenizer.json``; a clear `DataError` if it is missing or unreadable."""
    if not path.is_file():
        raise DataError(f"tokenizer file not found: {path} (pass a Hugging Face tokenizer.json with --tokenizer)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise DataError(f"cannot load tokenizer {path}: {e} (it must be a Hugging Face tokenizer.json)") from e


def train_byte_level_bpe(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE with ``<|endoftext|>`` as its only special token.

    `vocab_size` is a target: a small corpus may yield fewer merges, so read the real size from
    ``tokenizer.get_vocab_size()``.
    """
    if vocab_size < MIN_BPE_VOCAB_SIZE:
        raise DataError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE; it needs at least "
            f"{MIN_BPE_VOCAB_SIZE} (256 bytes + {ENDOFTEXT}). Use --vocab-size {MIN_BPE_VOCAB_SIZE} or more"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def find_eos_id(tokenizer: Tokenizer, eos_token: str | None = None) -> int:
    """The id of `eos_token`, or of the first known EOS token in the vocabulary when it is None."""
    if eos_token is not None:
        token_id = tokenizer.token_to_id(eos_token)
        if token_id is None:
            raise DataError(
                f"eos_token={eos_token!r} is not in the tokenizer's vocabulary; "
                "pass a token the tokenizer knows with --eos-token (eos_token=...)"
            )
        return token_id
    for candidate in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return token_id
    raise DataError(
        f"the tokenizer has none of the usual end-of-sequence tokens {list(EOS_CANDIDATES)}; "
        "name its EOS token with --eos-token (eos_token=...)"
    )
