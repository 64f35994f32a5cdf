"""Streaming DiLoCo with eager fragment updates, under its own strategy name.

``StreamingDiLoCo`` with ``eager=True`` (see the theory of operation in ``streaming.py``): the
overlap of Kale et al. (2025, arXiv 2502.12996) on top of Streaming DiLoCo's fragments, the
paper's headline configuration. A name of its own makes it selectable wherever a strategy is
chosen by name (run settings, ``lattica demo --strategy``, the benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass

from lattica.train.strategies.streaming import StreamingDiLoCo, StreamingDiLoCoConfig


@dataclass(frozen=True, kw_only=True)
class StreamingEagerConfig(StreamingDiLoCoConfig):
    eager: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.eager:
            raise ValueError("streaming_eager is always eager; choose the strategy 'streaming'")


class StreamingEagerDiLoCo(StreamingDiLoCo):
    replicas_agree = False
    name = "streaming_eager"
    config_class = StreamingEagerConfig
