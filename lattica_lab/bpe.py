"""A byte-level BPE tokenizer trained in-process with the ``tokenizers`` library (nothing is
downloaded): what tests and benchmarks give ``lattica data prepare``.

``train_bpe(texts, vocab_size, out)`` writes ``out`` (a ``tokenizer.json``) with the special
token ``<|endoftext|>`` (the end-of-document id ``lattica data prepare`` finds by itself).
``stdlib_texts(limit)`` gives text that ships with Python: the standard library's own sources.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from lattica.train.engine.data import stdlib_documents

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return out


def stdlib_texts(limit: int | None = None) -> Iterator[str]:
    """The standard library's ``.py`` sources as text, the first ``limit`` of them (sorted)."""
    for i, (_, data) in enumerate(stdlib_documents()):
        if limit is not None and i >= limit:
            return
        yield data.decode("utf-8", errors="replace")
