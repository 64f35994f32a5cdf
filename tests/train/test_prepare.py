"""``lattica data prepare`` and prepared corpora: shards, manifest, memory maps, bad input."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lattica.errors import ConfigError
from lattica.train.engine.data import (
    BatchConfig,
    BatchSampler,
    DataConfig,
    load_corpus,
    validation_batches,
)
from lattica.train.engine.prepare import PrepareConfig, prepare
from lattica.train.engine.tokenized import MappedTokens, open_prepared, read_manifest
from lattica_lab.daemons import run_cli

PARAGRAPH = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. "


def _jsonl(path: Path, count: int, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: f"{i}: {PARAGRAPH * (1 + i % 5)}"}) + "\n" for i in range(count)))
    return path


def _prepare(tmp_path, tokenizer, *inputs, **kwargs):
    out = kwargs.pop("out", tmp_path / "prepared")
    return prepare(PrepareConfig(inputs=tuple(inputs), tokenizer=tokenizer, out=out, **kwargs)), out


def test_jsonl_prepares_shards_and_a_manifest_that_describe_them(tmp_path, bpe_tokenizer):
    manifest, out = _prepare(tmp_path, bpe_tokenizer, _jsonl(tmp_path / "a.jsonl", 300), shard_tokens=4096)
    assert manifest.dtype == "uint16"
    assert manifest.vocab_size == 384
    assert manifest.tokenizer_sha256 == hashlib.sha256(bpe_tokenizer.read_bytes()).hexdigest()
    train, val = manifest.splits["train"], manifest.splits["val"]
    assert len(train.shards) > 1
    assert all(s.tokens <= 4096 for s in train.shards)
    assert train.documents + val.documents == 300
    assert val.documents > 0
    for shard in (*train.shards, *val.shards):
        data = (out / shard.file).read_bytes()
        assert len(data) == 2 * shard.tokens
        assert hashlib.sha256(data).hexdigest() == shard.sha256
    assert (out / "tokenizer.json").read_bytes() == bpe_tokenizer.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_tokens_are_the_tokenizers_with_end_of_document_ids(tmp_path, bpe_tokenizer):
    from tokenizers import Tokenizer

    source = tmp_path / "one.jsonl"
    source.write_text(json.dumps({"text": PARAGRAPH}) + "\n" + json.dumps({"text": "second document"}) + "\n")
    manifest, out = _prepare(tmp_path, bpe_tokenizer, source, val_fraction=0.01)
    tokenizer = Tokenizer.from_file(str(bpe_tokenizer))
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert manifest.eos_id == eos
    corpus = open_prepared(out)
    stream = torch.cat([corpus.train[torch.arange(len(corpus.train))], corpus.val[torch.arange(len(corpus.val))]])
    expected = {tuple([*tokenizer.encode(t).ids, eos]) for t in (PARAGRAPH, "second document")}
    parts = {
        tuple(corpus.train[torch.arange(len(corpus.train))].tolist()),
        tuple(corpus.val[torch.arange(len(corpus.val))].tolist()),
    }
    assert parts == expected
    assert len(stream) == sum(len(e) for e in expected)


def test_the_split_is_the_same_wherever_it_runs(tmp_path, bpe_tokenizer):
    source = _jsonl(tmp_path / "a.jsonl", 120)
    first, _ = _prepare(tmp_path, bpe_tokenizer, source, out=tmp_path / "one")
    second, _ = _prepare(tmp_path, bpe_tokenizer, source, out=tmp_path / "two")
    assert read_manifest(tmp_path / "one") == read_manifest(tmp_path / "two")
    assert first == second


def test_text_files_and_folders_big_files_are_split_into_pieces(tmp_path, bpe_tokenizer):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "big.txt").write_text((PARAGRAPH + "\n") * 4000)  # ~270 KiB: several pieces
    (folder / "sub" / "small.md").write_text("A small note.\n")
    (folder / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    (folder / ".hidden").write_text("hidden\n")
    manifest, _ = _prepare(tmp_path, bpe_tokenizer, folder, val_fraction=0.3)
    assert manifest.splits["train"].documents + manifest.splits["val"].documents == 6  # 5 pieces + the note
    assert manifest.splits["val"].documents >= 1


def test_parquet_input(tmp_path, bpe_tokenizer):
    pa = pytest.importorskip("pyarrow", reason="the hf extra (pip install 'lattica[hf]')")
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": [f"{i} {PARAGRAPH}" for i in range(80)]}), path)
    manifest, _ = _prepare(tmp_path, bpe_tokenizer, path, text_field="body")
    assert manifest.splits["train"].documents + manifest.splits["val"].documents == 80


def test_prepared_corpus_loads_as_a_memory_mapped_corpus_and_samples_like_a_tensor(tmp_path, bpe_tokenizer):
    _, out = _prepare(tmp_path, bpe_tokenizer, _jsonl(tmp_path / "a.jsonl", 200), shard_tokens=2048)
    corpus = load_corpus(DataConfig(source=str(out)))
    assert isinstance(corpus.train, MappedTokens)
    assert corpus.vocab_size == 384
    assert corpus.tokenizer == out / "tokenizer.json"
    assert corpus.content_hash == hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    assert 1.0 < corpus.bytes_per_token < 8.0
    in_memory = corpus.train[torch.arange(len(corpus.train))]
    config = BatchConfig(batch_size=4, context=32, seed=5, shard_index=1, num_shards=3)
    mapped, tensor = BatchSampler(corpus.train, config), BatchSampler(in_memory, config)
    for _ in range(5):  # windows across shard boundaries included
        (x1, y1), (x2, y2) = mapped.next_batch(), tensor.next_batch()
        assert torch.equal(x1, x2)
        assert torch.equal(y1, y2)
    assert validation_batches(corpus.val, batch_size=2, context=16, max_batches=2)


def _rss_and_read() -> tuple[int, int]:
    status = Path("/proc/self/status").read_text()
    # anonymous memory: what a process allocates (mapped file pages are RssFile, reclaimable)
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:"))
    io = Path("/proc/self/io").read_text()
    read = next(int(line.split()[1]) for line in io.splitlines() if line.startswith("rchar:"))
    return rss, read


def _write_raw_prepared(out: Path, tokens: int) -> None:
    """A prepared corpus of ``tokens`` random train tokens written directly (no tokenizer)."""
    out.mkdir()
    rng = np.random.default_rng(0)
    shards = {}
    for split, count in (("train", tokens), ("val", 4096)):
        data = rng.integers(0, 1000, count, dtype=np.uint16).astype("<u2").tobytes()
        (out / f"{split}-00000.bin").write_bytes(data)
        shard = {"file": f"{split}-00000.bin", "tokens": count, "sha256": hashlib.sha256(data).hexdigest()}
        shards[split] = {"documents": 1, "utf8_bytes": count * 3, "tokens": count, "shards": [shard]}
    manifest = {"format": "lattica-tokens", "version": 1, "dtype": "uint16", "val_fraction": 0.05, "splits": shards,
                "tokenizer": {"file": "tokenizer.json", "sha256": "0" * 64, "vocab_size": 1000, "eos_id": None}}
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_training_batches_read_the_shards_through_the_memory_map_not_whole(tmp_path):
    out = tmp_path / "big"
    _write_raw_prepared(out, 24 << 20)  # 48 MiB of train tokens
    shard_bytes = (out / "train-00000.bin").stat().st_size
    rss_before, _ = _rss_and_read()
    corpus = load_corpus(DataConfig(source=str(out), verify=True))  # sha256 streamed in 1 MiB pieces
    rss_opened, read_opened = _rss_and_read()
    sampler = BatchSampler(corpus.train, BatchConfig(batch_size=16, context=256, seed=1))
    for _ in range(50):
        sampler.next_batch()
    rss_after, read_after = _rss_and_read()
    assert rss_opened - rss_before < shard_bytes // 4  # hashing did not hold the shard in memory
    assert read_after - read_opened < shard_bytes // 100  # batches come through the map, not read()
    assert rss_after - rss_before < shard_bytes // 4  # only the pages of the windows were touched


# --------------------------------------------------------------------------- bad input


def test_a_jsonl_line_without_the_text_field_is_one_line_naming_file_and_line(tmp_path, bpe_tokenizer):
    source = tmp_path / "a.jsonl"
    source.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ConfigError, match=r"a\.jsonl:2: record has no field 'text'"):
        _prepare(tmp_path, bpe_tokenizer, source)
    assert not (tmp_path / "prepared").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("content", ["", "\n\n", json.dumps({"text": ""}) + "\n"])
def test_an_empty_corpus_is_refused(tmp_path, bpe_tokenizer, content):
    source = tmp_path / "empty.jsonl"
    source.write_text(content)
    with pytest.raises(ConfigError, match="no text"):
        _prepare(tmp_path, bpe_tokenizer, source)
    assert not (tmp_path / "prepared").exists()


def test_an_existing_out_is_refused_unless_forced(tmp_path, bpe_tokenizer):
    source = _jsonl(tmp_path / "a.jsonl", 50)
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="exists"):
        _prepare(tmp_path, bpe_tokenizer, source)
    assert (tmp_path / "prepared" / "mine.txt").read_text() == "keep"
    _prepare(tmp_path, bpe_tokenizer, source, force=True)
    assert not (tmp_path / "prepared" / "mine.txt").exists()
    assert (tmp_path / "prepared" / "manifest.json").exists()


def test_a_corrupted_or_missing_shard_is_refused(tmp_path, bpe_tokenizer):
    _, out = _prepare(tmp_path, bpe_tokenizer, _jsonl(tmp_path / "a.jsonl", 100))
    shard = out / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    open_prepared(out, verify=False)  # sizes still match
    with pytest.raises(ConfigError, match=r"train-00000\.bin is corrupted"):
        open_prepared(out)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ConfigError, match=r"has \d+ bytes, the manifest says"):
        open_prepared(out, verify=False)
    shard.unlink()
    with pytest.raises(ConfigError, match=r"train-00000\.bin is missing"):
        open_prepared(out, verify=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["splits"]["train"]["shards"][0].update(file="../escape.bin"), "plain file name"),
        (lambda m: m["splits"]["train"]["shards"][0].update(tokens=-1), "integer"),
        (lambda m: m["splits"]["train"].update(tokens=1), "sum of its shards"),
        (lambda m: m["tokenizer"].update(vocab_size=70_000), "does not fit uint16"),
        (lambda m: m.update(version=99), "format"),
        (lambda m: m["splits"].pop("val"), "exactly train, val"),
        (lambda m: m["splits"]["val"]["shards"][0].update(sha256="xyz"), "sha256"),
    ],
)
def test_a_hostile_manifest_is_one_line(tmp_path, bpe_tokenizer, change, message):
    _, out = _prepare(tmp_path, bpe_tokenizer, _jsonl(tmp_path / "a.jsonl", 60))
    manifest = json.loads((out / "manifest.json").read_text())
    change(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=message):
        open_prepared(out, verify=False)


def test_token_ids_outside_the_vocabulary_are_refused_when_read(tmp_path):
    out = tmp_path / "raw"
    _write_raw_prepared(out, 4096)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 10  # the shards hold ids up to 999
    (out / "manifest.json").write_text(json.dumps(manifest))
    corpus = open_prepared(out)
    with pytest.raises(ConfigError, match="outside its vocabulary of 10"):
        BatchSampler(corpus.train, BatchConfig(batch_size=2, context=8)).next_batch()


def test_cli_prepares_with_progress_on_stderr_and_errors_in_one_line(tmp_path, bpe_tokenizer):
    source = _jsonl(tmp_path / "a.jsonl", 40)

    def prepare(source: Path, tokenizer: Path, out: str):
        return run_cli(
            "data", "prepare", str(source), "--tokenizer", str(tokenizer), "--out", str(tmp_path / out), timeout=60
        )

    ok = prepare(source, bpe_tokenizer, "p")
    assert ok.returncode == 0, ok.stderr
    assert "done" in ok.stderr
    assert "train tokens" in ok.stdout
    again = prepare(source, bpe_tokenizer, "p")
    missing_tok = prepare(source, tmp_path / "nope.json", "q")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "x"}\n')
    no_field = prepare(bad, bpe_tokenizer, "r")
    for result, message in ((again, "exists"), (missing_tok, "does not exist"), (no_field, "has no field 'text'")):
        assert result.returncode == 1
        assert result.stderr.count("\n") == 1
        assert message in result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "q").exists()
    assert not (tmp_path / "r").exists()
    assert os.listdir(tmp_path / "p")


def test_join_refuses_a_corrupted_prepared_corpus_in_one_line(tmp_path, bpe_tokenizer):
    _, out = _prepare(tmp_path, bpe_tokenizer, _jsonl(tmp_path / "a.jsonl", 60))
    shard = out / "val-00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    result = run_cli("join", "--data-dir", str(tmp_path / "node"), "--train", "--metrics-addr", "off",
                     "--model", "llama-tiny", "--data", str(out), timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "val-00000.bin is corrupted" in result.stderr
