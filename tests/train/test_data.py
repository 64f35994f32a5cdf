import array
import importlib.util
import json

import pytest
import torch

from lattica.errors import ConfigError
from lattica.train.engine.data import (
    BatchConfig,
    BatchSampler,
    ByteTokenizer,
    DataConfig,
    load_corpus,
    stdlib_documents,
    validation_batches,
)


def test_byte_tokenizer_roundtrip():
    text = "héllo, wörld ✓"
    tokens = ByteTokenizer.encode(text)
    assert tokens.dtype == torch.int64
    assert int(tokens.max()) < 256
    assert ByteTokenizer.decode(tokens) == text


def test_stdlib_corpus_is_deterministic_and_excludes_tests():
    docs = stdlib_documents()
    names = [n for n, _ in docs]
    assert names == sorted(names)
    assert len(names) > 100
    assert not any(n.startswith("test/") or "/tests/" in n or "site-packages" in n for n in names)
    assert "os.py" in names
    a, b = load_corpus(DataConfig()), load_corpus(DataConfig())
    assert a.content_hash == b.content_hash
    assert torch.equal(a.val, b.val)
    assert a.train.numel() > 5 * a.val.numel() > 0


def test_text_file_split_by_position(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(bytes(range(32, 127)) * 20)
    corpus = load_corpus(DataConfig(source=str(path), val_fraction=0.1))
    assert corpus.train.numel() + corpus.val.numel() == 95 * 20
    assert corpus.val.numel() == 190
    assert bytes(corpus.val[:3].tolist()) == path.read_bytes()[-190:][:3]


def test_folder_skips_binary_and_hidden_files(tmp_path):
    (tmp_path / "sub").mkdir()
    for i in range(6):
        (tmp_path / "sub" / f"f{i}.md").write_text(f"document {i} " * 50)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    (tmp_path / ".hidden").write_text("secret " * 50)
    corpus = load_corpus(DataConfig(source=str(tmp_path)))
    assert corpus.num_documents == 6
    joined = bytes(torch.cat([corpus.train, corpus.val]).tolist())
    assert b"secret" not in joined
    assert b"\0" not in joined


def test_folder_without_text_is_a_config_error(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ConfigError, match="no text files"):
        load_corpus(DataConfig(source=str(tmp_path)))


def test_jsonl_reads_the_text_field(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"text": f"record number {i} " * 10, "id": i} for i in range(40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    corpus = load_corpus(DataConfig(source=str(path)))
    assert corpus.num_documents == 40
    joined = bytes(torch.cat([corpus.train, corpus.val]).tolist())
    assert b"record number 39" in joined
    assert b'"id"' not in joined


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"text": broken\n', "d.jsonl:2: not valid JSON"),
        ('{"body": "x"}\n', "no field 'text'"),
        ('{"text": 3}\n', "not a string"),
        ("[1, 2]\n", "expected a JSON object"),
        ("\n\n", "no records"),
        (b"\xff\xfe\n", "not valid JSON"),
    ],
)
def test_malformed_jsonl_is_a_config_error(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_corpus(DataConfig(source=str(path)))


def test_token_bin_is_read_as_little_endian_uint16(tmp_path):
    ids = array.array("H", [(i * 7919) % 50000 for i in range(1000)])
    path = tmp_path / "train.bin"
    path.write_bytes(ids.tobytes() if array.array("H", [1]).tobytes() == b"\1\0" else b"")
    corpus = load_corpus(DataConfig(source=str(path), val_fraction=0.1))
    assert corpus.train.tolist() + corpus.val.tolist() == list(ids)
    assert corpus.vocab_size == max(ids) + 1


def test_odd_length_bin_is_a_config_error(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\1\2\3")
    with pytest.raises(ConfigError, match="uint16"):
        load_corpus(DataConfig(source=str(path)))


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(DataConfig(source=str(tmp_path / "nope.txt")))
    empty = tmp_path / "e.txt"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="empty"):
        load_corpus(DataConfig(source=str(empty)))


def test_config_validation():
    with pytest.raises(ValueError, match="format"):
        DataConfig(format="csv")
    with pytest.raises(ValueError, match="shard_index"):
        BatchConfig(shard_index=4, num_shards=4)


def test_sampler_windows_shards_and_resume():
    tokens = torch.arange(4000) % 256
    cfg = dict(batch_size=4, context=16, seed=1, num_shards=4)
    s0 = BatchSampler(tokens, BatchConfig(shard_index=0, **cfg))
    s3 = BatchSampler(tokens, BatchConfig(shard_index=3, **cfg))
    x, y = s0.next_batch()
    assert x.shape == (4, 16)
    assert x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 1000 % 256 + 256  # drawn from shard 0 = tokens[0:1000]
    x3, _ = s3.next_batch()
    assert not torch.equal(x, x3)
    state = s0.state_dict()
    expected = s0.next_batch()
    s0_again = BatchSampler(tokens, BatchConfig(shard_index=0, **cfg))
    s0_again.load_state_dict(state)
    assert torch.equal(s0_again.next_batch()[0], expected[0])


def test_sampler_shard_bounds():
    tokens = torch.arange(4000)
    s = BatchSampler(tokens, BatchConfig(batch_size=64, context=8, shard_index=2, num_shards=4))
    x, _ = s.next_batch()
    assert int(x.min()) >= 2000
    assert int(x.max()) < 3000


def test_sampler_rejects_too_small_shard():
    with pytest.raises(ConfigError, match="fewer than context"):
        BatchSampler(torch.arange(50), BatchConfig(context=16, num_shards=4))


def test_validation_batches_are_fixed():
    tokens = torch.arange(1000)
    a = validation_batches(tokens, batch_size=4, context=8, max_batches=3)
    b = validation_batches(tokens, batch_size=4, context=8, max_batches=3)
    assert len(a) == 3
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b, strict=True))


def test_hf_without_datasets_installed_is_a_config_error(monkeypatch):
    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed")
    with pytest.raises(ConfigError, match="optional extra"):
        load_corpus(DataConfig(source="hf:some/dataset"))


def test_hf_dataset_saved_on_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"text": [f"row {i} " * 20 for i in range(30)], "n": list(range(30))}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    corpus = load_corpus(DataConfig(source=f"hf:{tmp_path / 'ds'}"))
    assert corpus.num_documents == 30
    with pytest.raises(ConfigError, match="no column"):
        load_corpus(DataConfig(source=f"hf:{tmp_path / 'ds'}", text_field="body"))
