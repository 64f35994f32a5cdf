"""Two tokenized corpora for ``benchmarks/convergence.py --model llama-tiny --data DIR``.

- ``stdlib``: the byte-level default corpus (the Python standard library's sources), one
  document per file;
- ``english``: English prose none of the defaults were tuned on — the quotations, literature
  and humour of Debian's ``fortunes`` package (``apt-get install fortunes``), one document per
  quotation.

For each, a byte-level BPE tokenizer (``--vocab``, default 1024) is trained in-process on the
corpus (``lattica_lab.bpe``; nothing downloaded) and ``lattica data prepare`` writes
``OUT/<corpus>``. The last line is one JSON object: per corpus its folder, token counts and
UTF-8 bytes per token.

    python benchmarks/prepare_corpora.py --out runs/corpora [--vocab 1024] [--fortunes DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica.errors import ConfigError
from lattica.train.engine.data import stdlib_documents
from lattica.train.engine.prepare import PrepareConfig, prepare
from lattica_lab.bpe import train_bpe

FORTUNES = Path("/usr/share/games/fortunes")


def stdlib_records() -> Iterator[dict[str, str]]:
    for name, data in stdlib_documents():
        yield {"name": name, "text": data.decode("utf-8", errors="replace")}


def fortune_records(folder: Path) -> Iterator[dict[str, str]]:
    """Every quotation of every fortune file (``%`` lines separate them; index files skipped)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and p.suffix != ".dat")
    if not files:
        raise ConfigError(f"no fortune files in {folder}: apt-get install fortunes")
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for i, quote in enumerate(text.split("\n%\n")):
            if quote.strip():
                yield {"name": f"{path.name}/{i}", "text": quote.strip() + "\n"}


def build(name: str, records: list[dict[str, str]], out: Path, vocab: int) -> dict[str, object]:
    folder = out / f"{name}-src"
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"{name}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = train_bpe((r["text"] for r in records), vocab, folder / "tokenizer.json")
    manifest = prepare(
        PrepareConfig(inputs=(source,), tokenizer=tokenizer, out=out / name, force=True),
        progress=lambda line: print(f"{name}: {line}", file=sys.stderr, flush=True),
    )
    train, val = manifest.splits["train"], manifest.splits["val"]
    return {
        "dir": str(out / name), "documents": train.documents + val.documents, "train_tokens": train.tokens,
        "val_tokens": val.tokens, "bytes_per_token": round(val.utf8_bytes / val.tokens, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/corpora"))
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--fortunes", type=Path, default=FORTUNES, help="folder of fortune files")
    args = parser.parse_args()
    try:
        summary = {
            "vocab": args.vocab,
            "stdlib": build("stdlib", list(stdlib_records()), args.out, args.vocab),
            "english": build("english", list(fortune_records(args.fortunes)), args.out, args.vocab),
        }
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
