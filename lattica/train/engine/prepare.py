"""``lattica data prepare``: text in, fixed-width token shards and a manifest out.

Theory of operation
-------------------
Inputs are read as a stream of named documents, never whole:

- ``.jsonl`` / ``.ndjson``: one JSON object per line, the text in ``text_field`` (a line
  without it is an error naming the file and line);
- ``.parquet`` (with ``pyarrow``): the ``text_field`` column, read a record batch at a time;
- any other file: UTF-8 text, cut at line ends into pieces of about ``TEXT_PIECE_BYTES`` (a
  big file is many documents, so it is split between train and validation too); files that
  look binary are skipped;
- a folder: every file below it (sorted; hidden ones skipped), each read as above.

A document goes to the validation split by a hash of its name (``data.is_validation_document``, as for
byte-level corpora), so the split is the same wherever the command runs. Documents are encoded
in batches by the ``tokenizers`` library, each followed by the tokenizer's end-of-document id
when it has one, and appended to the split's current shard (``uint16`` when the vocabulary
fits, else ``uint32``); a shard is closed at ``shard_tokens`` tokens. The sha256 of each shard
is computed while writing.

Everything is written into a temporary folder beside ``out`` that is renamed to ``out`` only
when complete (with ``force``, an existing ``out`` is replaced then): an error or an interrupt
leaves nothing half-written behind. When no document fell into the validation split, the last
training document goes there instead; an empty corpus is an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lattica.errors import ConfigError
from lattica.train.engine.data import is_validation_document
from lattica.train.engine.tokenized import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    PreparedManifest,
    ShardInfo,
    SplitInfo,
    dtype_for,
)

TEXT_PIECE_BYTES = 64 << 10
ENCODE_BATCH = 256
DEFAULT_SHARD_TOKENS = 100_000_000
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PROGRESS_EVERY_S = 2.0

Document = tuple[str, str]  # (name, text)


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    inputs: tuple[Path, ...]
    tokenizer: Path
    out: Path
    text_field: str = "text"
    val_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    eos: str | None = None  # the end-of-document token; None: the first of EOS_CANDIDATES it knows
    force: bool = False

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ConfigError("data prepare needs at least one input file or folder")
        if not self.text_field:
            raise ConfigError("--text-field must not be empty")
        if not 0.0 < self.val_fraction < 0.5:
            raise ConfigError(f"--val-fraction must be in (0, 0.5), got {self.val_fraction}")
        if self.shard_tokens < 1024:
            raise ConfigError(f"--shard-tokens must be at least 1024, got {self.shard_tokens}")


@dataclass
class _ShardWriter:
    """One split's shards: appends token arrays, rolls over at ``limit`` tokens, hashes as it goes."""

    folder: Path
    split: str
    dtype: np.dtype[Any]
    limit: int
    shards: list[ShardInfo] = field(default_factory=list)
    documents: int = 0
    utf8_bytes: int = 0
    _file: BinaryIO | None = None
    _hasher: Any = None
    _count: int = 0

    def write(self, tokens: np.ndarray, utf8_bytes: int) -> None:
        self.documents += 1
        self.utf8_bytes += utf8_bytes
        data = tokens.astype(self.dtype, copy=False)
        while data.size:
            if self._file is None:
                self._open()
            room = self.limit - self._count
            piece, data = data[:room], data[room:]
            raw = piece.tobytes()
            assert self._file is not None
            self._file.write(raw)
            self._hasher.update(raw)
            self._count += piece.size
            if self._count >= self.limit:
                self.close()

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = (self.folder / name).open("wb")
        self._hasher, self._count = hashlib.sha256(), 0

    def close(self) -> None:
        if self._file is None:
            return
        name = Path(self._file.name).name
        self._file.close()
        self._file = None
        self.shards.append(ShardInfo(file=name, tokens=self._count, sha256=self._hasher.hexdigest()))
        self._count = 0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards) + self._count

    def info(self) -> SplitInfo:
        self.close()
        return SplitInfo(shards=tuple(self.shards), documents=self.documents, utf8_bytes=self.utf8_bytes)


# --------------------------------------------------------------------------- documents


def iter_documents(inputs: tuple[Path, ...], text_field: str) -> Iterator[Document]:
    """Every document of the inputs, in order (module docstring)."""
    for root in inputs:
        if not root.exists():
            raise ConfigError(f"input {root} does not exist")
        if root.is_dir():
            for path in sorted(root.rglob("*")):
                rel = path.relative_to(root)
                if path.is_file() and not any(part.startswith(".") for part in rel.parts):
                    yield from _file_documents(path, text_field, name=f"{root.name}/{rel.as_posix()}")
        else:
            yield from _file_documents(root, text_field, name=root.name)


def _file_documents(path: Path, text_field: str, *, name: str) -> Iterator[Document]:
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        yield from _jsonl_documents(path, text_field, name)
    elif suffix == ".parquet":
        yield from _parquet_documents(path, text_field, name)
    else:
        yield from _text_documents(path, name)


def _jsonl_documents(path: Path, field_name: str, name: str) -> Iterator[Document]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                raise ConfigError(f"{path}:{lineno}: not valid JSON") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if field_name not in record:
                raise ConfigError(f"{path}:{lineno}: record has no field {field_name!r}")
            text = record[field_name]
            if not isinstance(text, str):
                raise ConfigError(f"{path}:{lineno}: field {field_name!r} is {type(text).__name__}, not a string")
            yield f"{name}:{lineno}", text


def _parquet_documents(path: Path, field_name: str, name: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: parquet input needs pyarrow: pip install 'lattica[hf]'") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise ConfigError(f"{path}: not a readable parquet file ({exc})") from None
    if field_name not in table.schema_arrow.names:
        raise ConfigError(f"{path}: parquet file has no column {field_name!r}")
    row = 0
    for batch in table.iter_batches(columns=[field_name]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ConfigError(f"{path}: row {row}: column {field_name!r} is not a string")
            yield f"{name}#{row}", text


def _text_documents(path: Path, name: str) -> Iterator[Document]:
    with path.open("rb") as f:
        if b"\0" in f.read(8192):
            return  # binary
        f.seek(0)
        piece: list[bytes] = []
        size, index = 0, 0
        for line in f:
            piece.append(line)
            size += len(line)
            if size >= TEXT_PIECE_BYTES:
                yield f"{name}@{index}", b"".join(piece).decode("utf-8", errors="replace")
                piece, size, index = [], 0, index + 1
        if piece:
            yield f"{name}@{index}", b"".join(piece).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- tokenizer


def load_tokenizer(path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` saved in ``path`` (a ``tokenizer.json``)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("tokenizing needs the tokenizers library: pip install 'lattica[hf]'") from None
    if not path.is_file():
        raise ConfigError(f"tokenizer {path} does not exist (a tokenizer.json of the tokenizers library)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own exception type for a bad file
        raise ConfigError(f"tokenizer {path} cannot be read: {exc}") from None


def eos_id_of(tokenizer: Any, eos: str | None) -> int | None:
    if eos is not None:
        token_id = tokenizer.token_to_id(eos)
        if token_id is None:
            raise ConfigError(f"the tokenizer has no token {eos!r} (--eos)")
        return int(token_id)
    for candidate in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return int(token_id)
    return None


# --------------------------------------------------------------------------- preparing


def prepare(config: PrepareConfig, *, progress: Callable[[str], None] = lambda line: None) -> PreparedManifest:
    """Tokenize the inputs into ``config.out`` (module docstring); the manifest written."""
    out = config.out
    if out.exists() and not config.force:
        raise ConfigError(f"{out} exists; choose another --out or pass --force to replace it")
    tokenizer = load_tokenizer(config.tokenizer)
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    eos_id = eos_id_of(tokenizer, config.eos)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(mode=0o755)
    except OSError as exc:
        raise ConfigError(f"cannot write beside {out}: {exc.strerror or exc}") from None
    try:
        manifest = _write_staging(config, staging, tokenizer, vocab_size, eos_id, progress)
        replace_folder(staging, out)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _write_staging(
    config: PrepareConfig, staging: Path, tokenizer: Any, vocab_size: int, eos_id: int | None,
    progress: Callable[[str], None],
) -> PreparedManifest:
    dtype = np.dtype(dtype_for(vocab_size)).newbyteorder("<")
    writers = {
        split: _ShardWriter(folder=staging, split=split, dtype=dtype, limit=config.shard_tokens)
        for split in ("train", "val")
    }
    meter = _Progress(progress)
    held: tuple[np.ndarray, int] | None = None  # the last train document: validation's if it gets none
    documents = (doc for doc in iter_documents(config.inputs, config.text_field) if doc[1])
    for batch in _batches(documents):
        encodings = tokenizer.encode_batch([text for _, text in batch], add_special_tokens=False)
        for (name, text), encoding in zip(batch, encodings, strict=True):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            if eos_id is not None:
                ids = np.append(ids, eos_id)
            nbytes = len(text.encode("utf-8"))
            if is_validation_document(name, config.val_fraction):
                writers["val"].write(ids, nbytes)
            else:
                if held is not None:
                    writers["train"].write(*held)
                held = (ids, nbytes)
            meter.add(nbytes, writers)
    if held is not None:
        writers["val" if writers["val"].tokens == 0 else "train"].write(*held)
    if writers["train"].tokens == 0 or writers["val"].tokens == 0:
        raise ConfigError(
            "the inputs hold no text" if writers["val"].tokens == 0 else
            "the inputs hold too little text to split into train and validation (at least two documents)"
        )
    manifest = PreparedManifest(
        dtype=dtype_for(vocab_size), vocab_size=vocab_size, tokenizer_sha256=_sha256_of(config.tokenizer),
        eos_id=eos_id, val_fraction=config.val_fraction,
        splits={split: writer.info() for split, writer in writers.items()},
    )
    shutil.copyfile(config.tokenizer, staging / TOKENIZER_NAME)
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n")
    meter.done(writers)
    return manifest


def _batches(documents: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for document in documents:
        batch.append(document)
        if len(batch) >= ENCODE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def replace_folder(staging: Path, out: Path) -> None:
    """Put the complete folder ``staging`` at ``out``, replacing what is there (``--force``)."""
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        staging.rename(out)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        staging.rename(out)


def _sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Progress:
    """A progress line at most every two seconds, and one at the end."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.started = self.last = time.monotonic()
        self.documents = 0
        self.bytes = 0

    def add(self, nbytes: int, writers: dict[str, _ShardWriter]) -> None:
        self.documents += 1
        self.bytes += nbytes
        now = time.monotonic()
        if now - self.last >= _PROGRESS_EVERY_S:
            self.last = now
            self.emit(self._line(writers, now))

    def done(self, writers: dict[str, _ShardWriter]) -> None:
        self.emit(self._line(writers, time.monotonic()) + " — done")

    def _line(self, writers: dict[str, _ShardWriter], now: float) -> str:
        rate = self.bytes / max(now - self.started, 1e-9) / 1e6
        return (
            f"{self.documents:,} documents, {self.bytes / 1e6:,.1f} MB of text: "
            f"{writers['train'].tokens:,} train + {writers['val'].tokens:,} validation tokens ({rate:.1f} MB/s)"
        )
