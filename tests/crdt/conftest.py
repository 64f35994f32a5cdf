from __future__ import annotations

import pytest
from crdt_helpers import make_replicas


@pytest.fixture
def pair():
    return make_replicas(2)
