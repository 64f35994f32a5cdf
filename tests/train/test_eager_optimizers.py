"""The trainer's own optimizers: ``torch.optim``'s arithmetic and state dicts, without importing
``torch._dynamo`` (a second of CPU at every start, a restarted member's first of all)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from lattica.train.engine.eager_optimizers import EagerAdamW, EagerSGD

# a trainer built by the daemon's factory, two rounds trained, checkpointed, rebuilt and resumed
# from its checkpoint, in an interpreter of its own (this one may have imported dynamo already)
_TRAIN_AND_RESUME = textwrap.dedent("""
    import sys
    from pathlib import Path
    import trio
    from lattica.config import TrainSettings
    from lattica.train.settings import trainer_factory
    from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

    data, checkpoints = sys.argv[1], Path(sys.argv[2])
    settings = TrainSettings(strategy="diloco", model="tiny", data=data, inner_steps=2, rounds=2,
                             device="cpu", warmup_steps=1, batch_size=2, seq_len=16)

    def trainer():
        group = InMemoryCollectiveGroup(["me"])
        parts = trainer_factory.TrainerParts(peer_id="me", collective=group.member("me"),
                                             groups=FixedGroups(["me"]), checkpoint_dir=checkpoints)
        return trainer_factory.build_trainer(settings, parts)

    trio.run(trainer().run)
    resumed = trainer()
    assert resumed.resume(), "no checkpoint to resume from"
    print("torch._dynamo" in sys.modules)
""")


def test_a_trainer_trains_and_resumes_without_importing_dynamo(tmp_path: Path, text_data: Any) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _TRAIN_AND_RESUME, text_data.source, str(tmp_path / "checkpoints")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False", "torch._dynamo was imported"


def _train(inner: Any, outer: Any) -> tuple[list[torch.Tensor], dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = inner(model.parameters())
    phi = [p.detach().clone() for p in model.parameters()]
    outer_optimizer = outer(phi)
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for p, live in zip(phi, model.parameters(), strict=True):
            p.grad = p - live.detach()
        outer_optimizer.step()
    return [*phi, *(p.detach() for p in model.parameters())], optimizer.state_dict(), outer_optimizer.state_dict()


def test_the_same_arithmetic_and_state_as_torch_optim() -> None:
    ours = _train(
        lambda ps: EagerAdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True),
        lambda ps: EagerSGD(ps, lr=0.7, momentum=0.9, nesterov=True, foreach=False),
    )
    theirs = _train(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, foreach=False),
    )
    assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0], strict=True))
    for mine, reference in ((ours[1], theirs[1]), (ours[2], theirs[2])):
        assert mine["param_groups"] == reference["param_groups"]
        assert mine["state"].keys() == reference["state"].keys()
        for index, entry in mine["state"].items():
            assert all(torch.equal(v, reference["state"][index][k]) for k, v in entry.items())
    # a state dict of torch.optim.AdamW (an older checkpoint) loads into ours
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    EagerAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True).load_state_dict(theirs[1])
