import itertools
import math

import pytest

from lattica.train.engine.schedule import ScheduleConfig, lr_multiplier


def test_warmup_then_cosine_to_floor():
    cfg = ScheduleConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_multiplier(0, cfg) == pytest.approx(0.1)
    assert lr_multiplier(9, cfg) == pytest.approx(1.0)
    assert lr_multiplier(10, cfg) == pytest.approx(1.0)
    assert lr_multiplier(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(500, cfg) == pytest.approx(0.1)
    values = [lr_multiplier(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_validation():
    with pytest.raises(ValueError, match="lr"):
        ScheduleConfig(lr=0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        ScheduleConfig(min_lr_ratio=2)
