"""Saves checkpoints in a loop, printing each step once ``save`` returned; killed by the test."""

import sys

import torch

from lattica.train.engine.checkpoint import CheckpointStore

store = CheckpointStore(sys.argv[1], keep=2)
latest = store.load_latest()
step = latest["step"] if latest else 0
weights = torch.randn(256, 1024)  # 1 MiB: a kill often lands mid-write
while True:
    step += 1
    store.save(step, {"step": step, "w": weights + step})
    print(step, flush=True)
