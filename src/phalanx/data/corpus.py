"""The bundled demo corpus: CPython's own help text, so a first run needs no download.

Role: write the English documentation topics that ship with every CPython (``pydoc_data.topics``,
the text behind ``help("if")``, about 0.5 MB across ~80 topics) to a JSONL file, one document per
topic, in sorted topic order so the file is byte-identical on every run of the same Python.

Must not know about: tokenization or token files; the result is an ordinary input for `prepare`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from phalanx.data.errors import DataError

DEMO_CORPUS_FILENAME = "demo_corpus.jsonl"


def demo_corpus_topics() -> dict[str, str]:
    """Topic name -> help text, from the standard library's ``pydoc_data.topics``."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise DataError(
            "the demo corpus needs the standard-library module pydoc_data, which this Python lacks "
            "(some distributions strip it); pass your own input files instead of --demo"
        ) from e
    return dict(topics)


def write_demo_corpus(path: Path) -> Path:
    """Write the demo corpus as JSONL (``{"topic": ..., "text": ...}`` per line) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    topics = demo_corpus_topics()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for topic in sorted(topics):
            f.write(json.dumps({"topic": topic, "text": topics[topic]}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
