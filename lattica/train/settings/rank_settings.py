"""The run settings a node of several devices cannot train with (``train.devices``)."""

from __future__ import annotations

from lattica.config import TrainSettings
from lattica.errors import ConfigError
from lattica.train.engine.ranks.devices import NodeDevices, resolve_devices
from lattica.train.strategies import strategy_class


def check_rank_settings(settings: TrainSettings) -> NodeDevices:
    """The node's devices, and with several the settings that cannot run on them: a strategy
    that averages gradients at every step (it would cross the WAN per step) or trains its own
    experts, and a node batch that does not split evenly into the ranks' slices."""
    node = resolve_devices(settings.devices, settings.device)
    if node.ranks == 1:
        return node
    strategy = strategy_class(settings.strategy)
    if strategy.syncs_gradients or strategy.trains_experts:
        raise ConfigError(f"strategy {settings.strategy} trains on one device per node; "
                          f"train.devices = {settings.devices!r} makes {node.ranks} ranks")
    if settings.batch_size % node.ranks:
        raise ConfigError(f"train.batch_size ({settings.batch_size}) is the node's batch, split between its "
                          f"{node.ranks} ranks: make it a multiple of {node.ranks}")
    per_rank = settings.batch_size // node.ranks
    if settings.micro_batches > per_rank:
        raise ConfigError(f"train.micro_batches ({settings.micro_batches}) must be at most each rank's "
                          f"batch ({per_rank} = batch_size / {node.ranks} ranks)")
    return node
