import textwrap

import pytest
import torch

from lattica.errors import ConfigError
from lattica.train.engine.task import Task, TaskContext, builtin_task, load_task

GOOD = """
import torch
from lattica.train.engine.task import Task

def make(ctx):
    model = torch.nn.Linear(4, 4)
    def batches():
        g = torch.Generator().manual_seed(ctx.seed + ctx.shard_index)
        while True:
            x = torch.randn(2, 4, generator=g)
            yield x, x
    return Task(model=model, train_batches=batches(),
                loss_fn=lambda m, x, y: torch.nn.functional.mse_loss(m(x), y))

def wrong_type(ctx):
    return {"model": None}

def raises(ctx):
    raise RuntimeError("boom")

def no_params(ctx):
    return Task(model=torch.nn.ReLU(), train_batches=iter([]))

not_callable = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_task_mod.py").write_text(textwrap.dedent(GOOD))
    (tmp_path / "broken_task_mod.py").write_text("import nonexistent_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_task_mod"


def test_user_entry_point_loads(user_module):
    task = load_task(f"{user_module}:make", TaskContext(shard_index=1, num_shards=2, seed=3))
    assert isinstance(task, Task)
    x, y = next(task.train_batches)
    assert x.shape == (2, 4)
    assert task.loss_fn(task.model, x, y).dim() == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "package.module:function"),
        ("user_task_mod:", "package.module:function"),
        ("user_task_mod:make; rm -rf /", "package.module:function"),
        ("missing_module_abc:make", "cannot import task module"),
        ("broken_task_mod:make", "nonexistent_dependency_xyz"),
        ("user_task_mod:nope", "has no attribute 'nope'"),
        ("user_task_mod:not_callable", "is not callable"),
        ("user_task_mod:wrong_type", "must return lattica.train.engine.task.Task"),
        ("user_task_mod:raises", "RuntimeError: boom"),
        ("user_task_mod:no_params", "no trainable parameters"),
    ],
)
def test_bad_entry_points_are_config_errors(user_module, spec, message):
    with pytest.raises(ConfigError, match=message):
        load_task(spec, TaskContext())


def test_builtin_task_shards_and_model(text_data):
    a = builtin_task(model="tiny", data=text_data, context=TaskContext(shard_index=0, num_shards=2))
    b = builtin_task(model="tiny", data=text_data, context=TaskContext(shard_index=1, num_shards=2))
    assert a.data_hash == b.data_hash
    assert not torch.equal(next(a.train_batches)[0], next(b.train_batches)[0])
    assert all(
        torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True)
    )
    assert a.val_batches
