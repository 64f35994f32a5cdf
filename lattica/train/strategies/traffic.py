"""What one node puts on the wire for a collective operation (for reports and benchmarks).

A butterfly (reduce-scatter + all-gather) all-reduce over ``n`` members sends ``2 (n-1)/n`` of
the encoded payload per member; a group of one sends nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lattica.numerics import codecs


def payload_bytes(tensors: Sequence[torch.Tensor], codec: str) -> int:
    return sum(codecs.encoded_size(t, codec) for t in tensors)


def allreduce_bytes(tensors: Sequence[torch.Tensor], group_size: int, codec: str) -> int:
    return (2 * (group_size - 1) * payload_bytes(tensors, codec)) // max(group_size, 1)
