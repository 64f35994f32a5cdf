import pytest

from lattica.train.data import DataConfig

TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


@pytest.fixture
def text_data(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return DataConfig(source=str(path))
