"""Training data: byte tokenizer, corpus loaders and per-peer batch sampling.

Theory of operation
-------------------
A *corpus* is a list of named documents turned into two flat token streams, train and
validation, plus a content hash that every peer can compare. Documents go to validation by a
hash of their name (stable when files are added), so the split is identical on every machine.

Sources (``DataConfig.source``):

- ``"stdlib"`` (default): the ``.py`` files of this Python's standard library — present on every
  machine without a download. Test suites, ``site-packages`` and caches are excluded; the file
  list is sorted, so the corpus (and its hash) is the same for the same Python version.
- a text file, or a folder of text files (binary files are skipped);
- a JSONL file (one object per line, text in ``text_field``);
- a nanoGPT-style ``.bin`` file of little-endian uint16 token ids (split by position);
- ``"hf:<name or saved dataset folder>"``: Hugging Face ``datasets`` (optional extra);
- a folder written by ``lattica data prepare`` (``manifest.json`` inside): tokens of the user's
  tokenizer, memory-mapped and never loaded whole (``train/engine/tokenized.py``); its content hash is
  the manifest's sha256.

Each peer samples random ``(x, y)`` windows from its own contiguous shard of the train stream
with its own seed (``BatchConfig``); the sampler state is checkpointable.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from lattica.errors import ConfigError
from lattica.train.engine.tokenized import MappedTokens, is_prepared, open_prepared

# a flat token stream: a tensor in memory, or the memory-mapped shards of a prepared corpus
TokenStream = torch.Tensor | MappedTokens

FORMATS = ("auto", "text", "jsonl", "bin", "hf")
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


# --------------------------------------------------------------------------- tokenizer


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocabulary 256, lossless, nothing to download."""

    vocab_size = 256

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)

    @staticmethod
    def decode(tokens: torch.Tensor) -> str:
        return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the corpus comes from and how it is split."""

    source: str = "stdlib"
    format: str = "auto"
    text_field: str = "text"
    hf_split: str = "train"
    val_fraction: float = 0.05
    verify: bool = True  # a prepared corpus: check every shard's sha256 when opening it

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("DataConfig.source must be 'stdlib', 'hf:<name>' or a path")
        if self.format not in FORMATS:
            raise ValueError(f"DataConfig.format must be one of {FORMATS}, got {self.format!r}")
        if not self.text_field:
            raise ValueError("DataConfig.text_field must not be empty")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(
                f"DataConfig.val_fraction must be in (0, 0.5), got {self.val_fraction}"
            )


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How one peer draws batches: its shard of the train stream and its seed."""

    batch_size: int = 8
    context: int = 128
    seed: int = 0
    shard_index: int = 0
    num_shards: int = 1

    def __post_init__(self) -> None:
        for name in ("batch_size", "context", "num_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"BatchConfig.shard_index must be in [0, {self.num_shards}), got {self.shard_index}"
            )


@dataclass(frozen=True)
class Corpus:
    """Flat token streams and the content hash of the whole corpus."""

    train: TokenStream
    val: TokenStream
    vocab_size: int
    content_hash: str
    description: str
    num_documents: int
    bytes_per_token: float = 1.0  # of the validation split: bits per byte = nats / ln 2 / this
    tokenizer: Path | None = None  # the tokenizer of a prepared corpus


# --------------------------------------------------------------------------- loading


def load_corpus(config: DataConfig) -> Corpus:
    """Load and split the corpus named by ``config``; bad input raises ``ConfigError``."""
    source, fmt = config.source, config.format
    if source == "stdlib":
        return _from_documents(stdlib_documents(), config, "Python standard library")
    if source.startswith("hf:") or fmt == "hf":
        return _from_documents(_hf_documents(source.removeprefix("hf:"), config), config, source)
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"data source {source!r} does not exist")
    if fmt == "auto" and is_prepared(path):
        return _from_prepared(path, verify=config.verify)
    if fmt == "auto":
        fmt = _guess_format(path)
    if fmt == "bin":
        return _from_token_file(path, config)
    if fmt == "jsonl":
        return _from_documents(_jsonl_documents(path, config.text_field), config, str(path))
    if path.is_dir():
        return _from_documents(_folder_documents(path), config, str(path))
    return _from_single_text(path, config)


def _from_prepared(path: Path, *, verify: bool) -> Corpus:
    prepared = open_prepared(path, verify=verify)
    splits = prepared.manifest.splits
    return Corpus(
        train=prepared.train,
        val=prepared.val,
        vocab_size=prepared.manifest.vocab_size,
        content_hash=prepared.manifest_hash,
        description=f"{path}: {splits['train'].tokens} + {splits['val'].tokens} tokens (prepared)",
        num_documents=splits["train"].documents + splits["val"].documents,
        bytes_per_token=prepared.bytes_per_token,
        tokenizer=path / "tokenizer.json",
    )


def _guess_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if path.is_file() and suffix == ".bin":
        return "bin"
    if path.is_file() and suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    return "text"


def stdlib_documents() -> list[tuple[str, bytes]]:
    """The standard library's own ``.py`` files as sorted ``(relative path, bytes)`` pairs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip_stdlib_dir(d))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                full = Path(dirpath, name)
                documents.append((full.relative_to(root).as_posix(), full.read_bytes()))
    documents.sort()
    if not documents:
        raise ConfigError(f"no Python sources found under {root}")
    return documents


def _skip_stdlib_dir(name: str) -> bool:
    return name in _STDLIB_SKIP_DIRS or name.startswith((".", "test"))


def _folder_documents(root: Path) -> list[tuple[str, bytes]]:
    documents = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        data = path.read_bytes()
        if data and b"\0" not in data[:8192]:
            documents.append((rel.as_posix(), data))
    if not documents:
        raise ConfigError(f"folder {root} contains no text files")
    return documents


def _jsonl_documents(path: Path, field: str) -> list[tuple[str, bytes]]:
    documents = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            documents.append((f"{lineno:09d}", _text_field(record, field, f"{path}:{lineno}")))
    if not documents:
        raise ConfigError(f"JSONL file {path} has no records")
    return documents


def _text_field(record: object, field: str, where: str) -> bytes:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if field not in record:
        raise ConfigError(f"{where}: record has no field {field!r}")
    text = record[field]
    if not isinstance(text, str):
        raise ConfigError(f"{where}: field {field!r} is {type(text).__name__}, not a string")
    return text.encode("utf-8")


def _hf_documents(name: str, config: DataConfig) -> list[tuple[str, bytes]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "Hugging Face datasets are an optional extra: pip install 'lattica[hf]'"
        ) from None
    try:
        if Path(name).is_dir():
            loaded = datasets.load_from_disk(name)
        else:
            loaded = datasets.load_dataset(name, split=config.hf_split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many unrelated types for a bad name or folder
        raise ConfigError(f"cannot load Hugging Face dataset {name!r}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if config.hf_split not in loaded:
            raise ConfigError(f"dataset {name!r} has no split {config.hf_split!r}")
        loaded = loaded[config.hf_split]
    if config.text_field not in loaded.column_names:
        raise ConfigError(f"dataset {name!r} has no column {config.text_field!r}")
    documents = [
        (f"{i:09d}", _text_field(row, config.text_field, f"{name}[{i}]"))
        for i, row in enumerate(loaded)
    ]
    if not documents:
        raise ConfigError(f"dataset {name!r} is empty")
    return documents


# --------------------------------------------------------------------------- splitting


def is_validation_document(name: str, fraction: float) -> bool:
    """Whether the document called ``name`` belongs to the validation split: a hash of the name,
    so the split is the same on every machine and stable when documents are added."""
    return _is_validation(name, fraction)


def _is_validation(name: str, fraction: float) -> bool:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _from_documents(documents: list[tuple[str, bytes]], config: DataConfig, what: str) -> Corpus:
    hasher = hashlib.sha256()
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for name, data in documents:
        hasher.update(len(name).to_bytes(8, "big") + name.encode("utf-8"))
        hasher.update(len(data).to_bytes(8, "big") + data)
        (val_parts if _is_validation(name, config.val_fraction) else train_parts).append(data)
    if not val_parts:  # tiny collections: hold out the last document
        val_parts.append(train_parts.pop())
    if not train_parts:
        raise ConfigError(f"{what}: needs at least two documents to split train/validation")
    return Corpus(
        train=_bytes_tensor(b"\n".join(train_parts)),
        val=_bytes_tensor(b"\n".join(val_parts)),
        vocab_size=ByteTokenizer.vocab_size,
        content_hash=hasher.hexdigest(),
        description=f"{what}: {len(documents)} documents",
        num_documents=len(documents),
    )


def _from_single_text(path: Path, config: DataConfig) -> Corpus:
    data = path.read_bytes()
    if not data:
        raise ConfigError(f"text file {path} is empty")
    tokens = _bytes_tensor(data)
    train, val = _split_by_position(tokens, config.val_fraction)
    return Corpus(
        train=train,
        val=val,
        vocab_size=ByteTokenizer.vocab_size,
        content_hash=hashlib.sha256(data).hexdigest(),
        description=f"{path}: {len(data)} bytes",
        num_documents=1,
    )


def _from_token_file(path: Path, config: DataConfig) -> Corpus:
    data = path.read_bytes()
    if not data or len(data) % 2:
        raise ConfigError(
            f"{path}: a token .bin must hold little-endian uint16 ids (even, non-zero length); "
            f"it has {len(data)} bytes"
        )
    ids = array.array("H")
    ids.frombytes(data)
    if sys.byteorder == "big":  # the file format is little-endian
        ids.byteswap()
    tokens = torch.frombuffer(ids, dtype=torch.uint16).to(torch.int32)
    train, val = _split_by_position(tokens, config.val_fraction)
    return Corpus(
        train=train,
        val=val,
        vocab_size=int(tokens.max()) + 1,
        content_hash=hashlib.sha256(data).hexdigest(),
        description=f"{path}: {tokens.numel()} tokens",
        num_documents=1,
    )


def _split_by_position(tokens: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_val = max(1, int(tokens.numel() * fraction))
    if tokens.numel() - n_val < 2:
        raise ConfigError(f"corpus of {tokens.numel()} tokens is too small to split")
    return tokens[:-n_val], tokens[-n_val:]


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# --------------------------------------------------------------------------- batching


class BatchSampler:
    """Random ``(x, y)`` windows from this peer's shard; ``y`` is ``x`` shifted by one token."""

    def __init__(self, tokens: TokenStream, config: BatchConfig) -> None:
        shard = len(tokens) // config.num_shards
        start = config.shard_index * shard
        self.tokens = tokens[start : start + shard]
        self.config = config
        if len(self.tokens) < config.context + 1:
            raise ConfigError(
                f"shard {config.shard_index}/{config.num_shards} has {len(self.tokens)} tokens, "
                f"fewer than context + 1 = {config.context + 1}; use more data or fewer shards"
            )
        self._generator = torch.Generator().manual_seed(
            config.seed * 1_000_003 + config.shard_index
        )

    def next_batch(self, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch; ``rows``: only those of its windows are read (one rank's slice of a
        node's batch — the sampler moves on by the whole batch either way)."""
        c = self.config
        high = len(self.tokens) - c.context
        starts = torch.randint(0, high, (c.batch_size,), generator=self._generator)
        return _windows(self.tokens, starts[rows], c.context)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        generator = state["generator"]
        if not isinstance(generator, torch.Tensor):
            raise TypeError(f"sampler state 'generator' is {type(generator).__name__}, not a tensor")
        self._generator.set_state(generator)


def validation_batches(
    tokens: TokenStream, *, batch_size: int, context: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evenly spaced windows over the validation stream: the same on every peer."""
    available = len(tokens) - context - 1
    if available < 0:
        raise ConfigError(f"validation split ({len(tokens)} tokens) is shorter than the context")
    count = max(1, min(batch_size * max_batches, available + 1))
    starts = torch.linspace(0, available, count).long()
    return [
        _windows(tokens, starts[i : i + batch_size], context) for i in range(0, count, batch_size)
    ]


def _windows(
    tokens: TokenStream, starts: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(context + 1)
    chunk = tokens[starts[:, None] + offsets[None, :]].to(torch.int64)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
