"""All-reduce across real peer processes on loopback: exact means, lossy bounds, dead peers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from lattica_lab.peer_driver import run_all, spawn_peers
from lattica_lab.peer_main import make_input

NUMEL = 100_003  # not divisible by 2..5: parts of unequal length


@pytest.fixture(scope="module")
def five_fast_peers():
    with spawn_peers(5) as peers:
        yield peers


def _exact_mean(seeds: list[int], numel: int) -> torch.Tensor:
    total = torch.zeros(numel)
    for seed in seeds:  # group order, as every reducer sums
        total += make_input(numel, seed)
    return total / len(seeds)


def _allreduce(peers, tag, tmp_path: Path, codec="fp32", numel=NUMEL):
    group = [p.peer_id for p in peers]
    cmds = [
        {"op": "allreduce", "group": group, "tag": tag, "numel": numel, "seed": 100 + i,
         "codec": codec, "deadline_s": 20.0, "out": str(tmp_path / f"{tag}-{i}.bin")}
        for i in range(len(peers))
    ]
    replies = run_all(peers, cmds)
    assert all(r["ok"] for r in replies), replies
    outs = [torch.frombuffer(bytearray((tmp_path / f"{tag}-{i}.bin").read_bytes()), dtype=torch.float32)
            for i in range(len(peers))]
    return replies, outs, _exact_mean([100 + i for i in range(len(peers))], numel)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_allreduce_equals_exact_mean(five_fast_peers, tmp_path, n):
    replies, outs, exact = _allreduce(five_fast_peers[:n], f"exact{n}", tmp_path)
    for out in outs:
        assert torch.equal(out, exact)
    bound = 2 * (n - 1) / n * NUMEL * 4
    for reply in replies:  # every peer sends ~2(N-1)/N of the payload (plus small headers)
        assert bound <= reply["bytes_sent"] <= bound * 1.01 + 4096


def test_lossy_allreduce_is_identical_everywhere_and_within_bound(five_fast_peers, tmp_path):
    _, outs, exact = _allreduce(five_fast_peers[:3], "int8", tmp_path, codec="int8")
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    # int8: each contribution and the mean are within absmax/254 per block; inputs are N(0,1)
    # so |x| < 6 with overwhelming probability: the error stays below 2 * 6/254.
    assert (outs[0] - exact).abs().max().item() < 2 * 6 / 254


def test_allreduce_over_plain_libp2p_streams(tmp_path):
    with spawn_peers(2, fast=False) as peers:
        _, outs, exact = _allreduce(peers, "nofast", tmp_path)
        for out in outs:
            assert torch.equal(out, exact)
        stats = peers[0].command({"op": "stats"})
        assert all(set(paths) == {"libp2p"} for paths in stats["bytes_sent"].values())


def test_sigkilled_peer_gives_clean_failure_within_deadline(tmp_path):
    with spawn_peers(3) as peers:
        group = [p.peer_id for p in peers]
        victim, survivors = peers[2], peers[:2]
        numel = 2_000_000
        base = {"group": group, "tag": "doomed", "numel": numel}
        assert victim.command({"op": "send_then_hang", **base, "seed": 2})["hanging"]
        for i, peer in enumerate(survivors):
            peer.send({"op": "allreduce", **base, "seed": i, "deadline_s": 10.0, "out": None})
        time.sleep(0.5)
        victim.kill()
        start = time.monotonic()
        replies = [peer.read(15.0) for peer in survivors]
        assert time.monotonic() - start < 10.0
        for reply in replies:
            assert reply["ok"] is False
            assert reply["error"] == "aborted", reply
            assert victim.peer_id in reply["failed_peers"]
        # The survivors are healthy and can retry without the dead peer.
        _, outs, exact = _allreduce(survivors, "retry", tmp_path)
        assert torch.equal(outs[0], exact)
