"""``lattica data prepare``: tokenize a corpus into memory-mappable shards (``train/engine/prepare.py``).

Progress goes to stderr, the summary to stdout; every error is one line and leaves nothing
half-written. The parser imports nothing of ``lattica.train``: ``lattica status`` and the other
commands start without torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = sub.add_parser("data", help="prepare training data (tokenize a corpus into shards)")
    actions = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare", help="tokenize JSONL, text files or folders (and parquet with pyarrow) into token shards",
    )
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="file or folder (repeatable)")
    prepare.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json (tokenizers library)")
    prepare.add_argument("--out", type=Path, required=True, help="folder to write (must not exist, unless --force)")
    prepare.add_argument(
        "--text-field", default="text", help="JSONL field / parquet column with the text (default: text)"
    )
    prepare.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out (default 0.05)")
    prepare.add_argument("--shard-tokens", type=int, help="tokens per shard file (default 100,000,000)")
    prepare.add_argument(
        "--eos", help="end-of-document token (default: <|endoftext|>, </s>, … if the tokenizer has one)"
    )
    prepare.add_argument("--force", action="store_true", help="replace --out if it exists")


def data(args: argparse.Namespace) -> int:
    from lattica.train.engine.prepare import DEFAULT_SHARD_TOKENS, PrepareConfig, prepare

    config = PrepareConfig(
        inputs=tuple(args.inputs), tokenizer=args.tokenizer, out=args.out, text_field=args.text_field,
        val_fraction=args.val_fraction, shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, eos=args.eos,
        force=args.force,
    )
    manifest = prepare(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    train, val = manifest.splits["train"], manifest.splits["val"]
    print(
        f"prepared {args.out}: {train.tokens:,} train tokens in {len(train.shards)} shard(s), "
        f"{val.tokens:,} validation tokens; vocabulary {manifest.vocab_size:,} ({manifest.dtype})"
    )
    print(f'train on it with: [train] data = "{args.out}"')
    return 0
