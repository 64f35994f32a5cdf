"""``benchmarks/convergence.py`` on a device and with a larger dense model."""

from __future__ import annotations

import pytest
import torch
import trio

from lattica_lab.benchmark_scripts import load
from lattica_lab.collective import InMemoryCollectiveGroup, _mean_on_device


def test_model_replaces_the_dense_tiny_of_every_method_but_the_experts() -> None:
    convergence = load("convergence")
    methods = convergence.with_model(convergence.all_methods(4), "mini", 256, 128)
    assert methods["diloco"].build_model(0).config.d_model == 128
    assert methods["ddp"].build_model is methods["diloco"].build_model  # one model per run: one warm start
    assert methods["spes"].build_model is convergence.METHODS["spes"].build_model


def test_memory_measurement_on_a_device_and_a_missing_device_are_refused(capsys) -> None:
    convergence = load("convergence")
    assert convergence.main(["--measure-memory", "--device", "cuda"]) == 2
    assert "CPU only" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert convergence.main(["--device", "cuda", "--steps", "50"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convergence.main(["--model", "huge"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err


async def test_the_device_mean_is_the_plain_fp32_mean_in_group_order() -> None:
    """What the in-memory collective computes for accelerator tensors, checked on the CPU."""
    gen = torch.Generator().manual_seed(0)
    group = ("a", "b", "c")
    deposits = {p: [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)] for p in group}
    means = _mean_on_device(deposits, group, "fp32")
    network = InMemoryCollectiveGroup(group)
    results = {}

    async def member(peer):
        results[peer] = await network.member(peer).allreduce(deposits[peer], group=group, tag="t")

    async with trio.open_nursery() as nursery:
        for peer in group:
            nursery.start_soon(member, peer)
    for got, want in zip(means["a"], results["a"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
