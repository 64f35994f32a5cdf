"""Prepared (tokenized) corpora: the manifest, its validation, and memory-mapped token streams.

Theory of operation
-------------------
``lattica data prepare`` (``train/engine/prepare.py``) writes a folder:

- ``manifest.json``: the format tag, the token width (``uint16`` when the vocabulary fits,
  else ``uint32``), the tokenizer's vocabulary size, sha256 and end-of-document id, and per
  split (``train``, ``val``) the shard files with their token counts and sha256s, plus the
  split's UTF-8 byte count (for bits per byte);
- ``tokenizer.json``: a copy of the tokenizer the tokens came from;
- ``train-00000.bin`` …, ``val-00000.bin`` …: little-endian token ids, fixed width, no header.

Every member of a run compares the sha256 of ``manifest.json`` (the *manifest hash*, which
covers every shard's hash and the tokenizer's): same hash, same tokens.

A prepared folder is untrusted input like any file: the manifest is size-bounded and checked
field by field (names are plain file names inside the folder, counts are integers, hashes are
hex), each shard's size must be its token count times the width, and ``open_prepared(verify=
True)`` streams every shard through sha256 (bounded memory) and refuses a mismatch. Token ids
at or above the vocabulary are refused when a batch is read. Every problem is one
``ConfigError`` line.

Shards are read through ``numpy.memmap``: opening a corpus of any size maps it, and a batch
touches only the pages of its windows. ``MappedTokens`` makes the shards of a split one
stream with the two operations the batch sampler uses: ``len`` and indexing — by a slice (a
view, for a peer's part of the stream) or by a tensor of positions (the windows).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from lattica.errors import ConfigError

MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
FORMAT = "lattica-tokens"
VERSION = 1
DTYPES = {"uint16": 2, "uint32": 4}
SPLITS = ("train", "val")
MAX_MANIFEST_BYTES = 16 << 20
MAX_SHARDS = 100_000
_FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class ShardInfo:
    file: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class SplitInfo:
    shards: tuple[ShardInfo, ...]
    documents: int
    utf8_bytes: int

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


@dataclass(frozen=True)
class PreparedManifest:
    dtype: str
    vocab_size: int
    tokenizer_sha256: str
    eos_id: int | None
    val_fraction: float
    splits: Mapping[str, SplitInfo]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "tokenizer": {
                "file": TOKENIZER_NAME, "sha256": self.tokenizer_sha256, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id,
            },
            "val_fraction": self.val_fraction,
            "splits": {
                name: {
                    "documents": split.documents,
                    "utf8_bytes": split.utf8_bytes,
                    "tokens": split.tokens,
                    "shards": [{"file": s.file, "tokens": s.tokens, "sha256": s.sha256} for s in split.shards],
                }
                for name, split in self.splits.items()
            },
        }


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# --------------------------------------------------------------------------- the manifest


def parse_manifest(raw: bytes, where: str) -> PreparedManifest:
    """The manifest in ``raw`` (from ``where``), checked field by field."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ConfigError(f"{where}: manifest of {len(raw)} bytes is over the {MAX_MANIFEST_BYTES} limit")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ConfigError(f"{where}: manifest is not valid JSON") from None
    fields = _mapping(data, where, "manifest")
    if fields.get("format") != FORMAT or fields.get("version") != VERSION:
        raise ConfigError(f"{where}: not a prepared corpus of format {FORMAT} version {VERSION}")
    dtype = fields.get("dtype")
    if dtype not in DTYPES:
        raise ConfigError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    tokenizer = _mapping(fields.get("tokenizer"), where, "tokenizer")
    vocab_size = _count(tokenizer.get("vocab_size"), where, "tokenizer.vocab_size", minimum=1)
    if vocab_size > 1 << (8 * DTYPES[dtype]):
        raise ConfigError(f"{where}: a vocabulary of {vocab_size} does not fit {dtype} tokens")
    eos = tokenizer.get("eos_id")
    eos_id = None if eos is None else _count(eos, where, "tokenizer.eos_id")
    if eos_id is not None and eos_id >= vocab_size:
        raise ConfigError(f"{where}: tokenizer.eos_id {eos_id} is outside the vocabulary of {vocab_size}")
    fraction = fields.get("val_fraction")
    if not isinstance(fraction, float | int) or isinstance(fraction, bool) or not 0 < fraction < 0.5:
        raise ConfigError(f"{where}: val_fraction must be a number in (0, 0.5), got {fraction!r}")
    splits_raw = _mapping(fields.get("splits"), where, "splits")
    if set(splits_raw) != set(SPLITS):
        raise ConfigError(f"{where}: splits must be exactly {', '.join(SPLITS)}")
    splits = {name: _parse_split(splits_raw[name], where, name) for name in SPLITS}
    files = [s.file for split in splits.values() for s in split.shards]
    if len(set(files)) != len(files) or {MANIFEST_NAME, TOKENIZER_NAME} & set(files):
        raise ConfigError(f"{where}: shard file names must be distinct and not the manifest's or tokenizer's")
    return PreparedManifest(
        dtype=dtype, vocab_size=vocab_size,
        tokenizer_sha256=_sha256(tokenizer.get("sha256"), where, "tokenizer.sha256"),
        eos_id=eos_id, val_fraction=float(fraction), splits=splits,
    )


def _parse_split(raw: object, where: str, name: str) -> SplitInfo:
    split = _mapping(raw, where, f"splits.{name}")
    shards_raw = split.get("shards")
    if not isinstance(shards_raw, list) or not 0 < len(shards_raw) <= MAX_SHARDS:
        raise ConfigError(f"{where}: splits.{name}.shards must be a list of 1 to {MAX_SHARDS} shards")
    shards = []
    for i, item in enumerate(shards_raw):
        shard = _mapping(item, where, f"splits.{name}.shards[{i}]")
        file = shard.get("file")
        if not isinstance(file, str) or not _FILE_NAME.match(file):
            raise ConfigError(f"{where}: splits.{name}.shards[{i}].file must be a plain file name, got {file!r}")
        shards.append(ShardInfo(
            file=file,
            tokens=_count(shard.get("tokens"), where, f"splits.{name}.shards[{i}].tokens", minimum=1),
            sha256=_sha256(shard.get("sha256"), where, f"splits.{name}.shards[{i}].sha256"),
        ))
    info = SplitInfo(
        shards=tuple(shards),
        documents=_count(split.get("documents"), where, f"splits.{name}.documents", minimum=1),
        utf8_bytes=_count(split.get("utf8_bytes"), where, f"splits.{name}.utf8_bytes", minimum=1),
    )
    if split.get("tokens") != info.tokens:
        raise ConfigError(f"{where}: splits.{name}.tokens is not the sum of its shards' tokens")
    return info


def _mapping(value: object, where: str, what: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {what} must be a JSON object")
    return value


def _count(value: object, where: str, what: str, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value < 1 << 62:
        raise ConfigError(f"{where}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _sha256(value: object, where: str, what: str) -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise ConfigError(f"{where}: {what} must be a sha256 hex digest")
    return value


# --------------------------------------------------------------------------- opening


def is_prepared(path: Path) -> bool:
    """Whether ``path`` is a folder holding a prepared corpus's manifest."""
    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB pieces (never whole)."""
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


@dataclass(frozen=True)
class PreparedCorpus:
    manifest: PreparedManifest
    manifest_hash: str  # sha256 of manifest.json: what every member compares
    train: MappedTokens
    val: MappedTokens
    directory: Path

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per token of the validation split (bits per byte = nats / ln 2 / this)."""
        val = self.manifest.splits["val"]
        return val.utf8_bytes / val.tokens


def read_manifest(directory: Path) -> tuple[PreparedManifest, str]:
    """The manifest of the prepared corpus in ``directory`` and its hash."""
    path = directory / MANIFEST_NAME
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_manifest(raw, str(path)), hashlib.sha256(raw).hexdigest()


def open_prepared(directory: Path, *, verify: bool = True) -> PreparedCorpus:
    """Map the shards of the prepared corpus in ``directory``. Every shard must exist with the
    size its token count gives; with ``verify`` its sha256 must also match the manifest's."""
    manifest, manifest_hash = read_manifest(directory)
    width = DTYPES[manifest.dtype]
    streams = {}
    for name in SPLITS:
        shards = manifest.splits[name].shards
        for shard in shards:
            _check_shard(directory / shard.file, shard, width, verify=verify)
        streams[name] = MappedTokens.of_files(
            [directory / s.file for s in shards], [s.tokens for s in shards], manifest.dtype, manifest.vocab_size,
        )
    return PreparedCorpus(
        manifest=manifest, manifest_hash=manifest_hash, train=streams["train"], val=streams["val"], directory=directory,
    )


def _check_shard(path: Path, shard: ShardInfo, width: int, *, verify: bool) -> None:
    try:
        size = path.stat().st_size
    except OSError:
        raise ConfigError(f"prepared corpus: shard {path} is missing") from None
    if size != shard.tokens * width:
        raise ConfigError(
            f"prepared corpus: shard {path} has {size} bytes, the manifest says {shard.tokens} tokens "
            f"({shard.tokens * width} bytes)"
        )
    if verify:
        try:
            digest = file_sha256(path)
        except OSError as exc:
            raise ConfigError(f"prepared corpus: cannot read shard {path}: {exc.strerror or exc}") from None
        if digest != shard.sha256:
            raise ConfigError(
                f"prepared corpus: shard {path} is corrupted (sha256 {digest[:12]}…, manifest {shard.sha256[:12]}…)"
            )


# --------------------------------------------------------------------------- the token stream


class MappedTokens:
    """Shards of token ids as one stream: ``len``, slices (views) and gathers by position."""

    def __init__(self, shards: Sequence[np.ndarray], vocab_size: int, start: int = 0, stop: int | None = None) -> None:
        self._shards = list(shards)
        self._bounds = [0]
        for shard in self._shards:
            self._bounds.append(self._bounds[-1] + len(shard))
        self._start = start
        self._stop = self._bounds[-1] if stop is None else stop
        self.vocab_size = vocab_size

    @classmethod
    def of_files(cls, paths: Sequence[Path], counts: Sequence[int], dtype: str, vocab_size: int) -> MappedTokens:
        little = np.dtype(dtype).newbyteorder("<")
        shards = [np.memmap(p, dtype=little, mode="r", shape=(n,)) for p, n in zip(paths, counts, strict=True)]
        return cls(shards, vocab_size)

    def __len__(self) -> int:
        return self._stop - self._start

    def numel(self) -> int:
        return len(self)

    @overload
    def __getitem__(self, index: slice) -> MappedTokens: ...

    @overload
    def __getitem__(self, index: torch.Tensor) -> torch.Tensor: ...

    def __getitem__(self, index: slice | torch.Tensor) -> MappedTokens | torch.Tensor:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("MappedTokens slices take no step")
            return MappedTokens(self._shards, self.vocab_size, self._start + start, self._start + max(start, stop))
        return self._gather(index)

    def _gather(self, positions: torch.Tensor) -> torch.Tensor:
        flat = positions.reshape(-1).numpy().astype(np.int64) + self._start
        if flat.size and (flat.min() < self._start or flat.max() >= self._stop):
            raise IndexError("position outside the token stream")
        out = np.empty(flat.shape, dtype=np.int64)
        which = np.searchsorted(self._bounds, flat, side="right") - 1
        for s in np.unique(which):
            mask = which == s
            out[mask] = self._shards[s][flat[mask] - self._bounds[s]]
        if out.size and out.max() >= self.vocab_size:
            raise ConfigError(
                f"prepared corpus holds token id {int(out.max())}, outside its vocabulary of {self.vocab_size}"
            )
        return torch.from_numpy(out).reshape(positions.shape)


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """Validation loss in bits per UTF-8 byte: comparable across tokenizers."""
    return nats_per_token / math.log(2) / bytes_per_token
