#!/usr/bin/env bash
# Create .venv with Lattica and its test tools. Torch is pinned to the CPU build first so that
# no multi-GB CUDA wheel is pulled in by accident; on a GPU machine install your CUDA torch
# into the venv before running this script and it is kept. The hf extra (transformers,
# tokenizers, safetensors, pyarrow, datasets) is installed too: the tests of prepared data,
# hf: models and export use it; its torch requirement is met by the pinned one.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e '.[dev,hf]'
# bytecode of the checkout's own modules, as pip writes it for an installed package: where
# PYTHONDONTWRITEBYTECODE is set, every daemon start (and restart) would compile lattica's ~160
# modules from source again (~0.3 s of CPU; a module edited since is compiled in memory as before)
.venv/bin/python -m compileall -q lattica lattica_lab >/dev/null
echo "setup done: .venv/bin/lattica --help"
