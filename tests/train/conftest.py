import pytest

from lattica.train.engine.data import DataConfig

TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


@pytest.fixture
def text_data(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return DataConfig(source=str(path))


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer (vocabulary 384, <|endoftext|>) trained here on stdlib sources."""
    pytest.importorskip("tokenizers", reason="the hf extra (pip install 'lattica[hf]')")
    from lattica_lab.bpe import stdlib_texts, train_bpe

    return train_bpe(stdlib_texts(60), 384, tmp_path_factory.mktemp("bpe") / "tokenizer.json")
