"""``benchmarks/convergence.py``: ``--workers`` and the gossip-averaged DiLoCo method."""

from __future__ import annotations

import pytest
import trio

from lattica.train.engine.data import DataConfig, load_corpus
from lattica_lab import convergence_workers
from lattica_lab.benchmark_scripts import load


def test_workers_size_the_swarm_and_spes_owners() -> None:
    convergence = load("convergence")
    methods = convergence.all_methods(8)
    assert methods["spes"].config.members == tuple(f"worker-{i}" for i in range(8))
    gossip = methods["diloco_gossip"]
    assert (gossip.strategy, gossip.config.averaging, gossip.config.group_size) == ("diloco", "gossip", 2)
    assert gossip.evaluate_average


def test_too_few_workers_is_refused(capsys) -> None:
    assert load("convergence").main(["--workers", "1"]) == 2
    assert "--workers must be at least 2" in capsys.readouterr().err


def test_gossip_on_four_workers_averages_in_pairs_and_reports_the_ratio(tmp_path) -> None:
    convergence = load("convergence")
    corpus_path = tmp_path / "corpus.txt"
    corpus_path.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(3000)))
    corpus = load_corpus(DataConfig(source=str(corpus_path)))
    budget = convergence_workers.Budget(steps=50, batch_size=2, context=32, warmup=5, eval_batches=2)
    methods = convergence.all_methods(4)
    results = {
        name: trio.run(convergence_workers.run_method, name, methods[name], corpus, budget, 0, None, 4)
        for name in ("diloco", "diloco_gossip")
    }
    # pairs send φ and Δ to one partner: 2 x the weights; a 4-peer all-reduce 2 (N-1)/N = 1.5 x
    assert results["diloco_gossip"]["bytes"] / results["diloco"]["bytes"] == pytest.approx(2 / 1.5, rel=1e-3)
    assert "avg_weights_loss" in results["diloco_gossip"]
    summary = convergence.summary_json(results, 0, 1, 4)
    assert summary["workers"] == 4
    assert "diloco_gossip_vs_diloco" in summary
