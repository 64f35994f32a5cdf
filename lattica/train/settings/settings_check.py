"""Start-up checks of the run settings: fail before the daemon serves, as one line.

``TrainSettings`` checks what each value looks like; this checks what the names point to — the
strategy, the model preset, the data source, the task entry point, the strategy's own config —
so a typo ends ``lattica join`` at once instead of leaving a daemon up with an idle training
service and the error only in its log.
"""

from __future__ import annotations

import os
from pathlib import Path

from lattica.config import TrainSettings
from lattica.errors import ConfigError
from lattica.train.settings.rank_settings import check_rank_settings
from lattica.train.settings.strategy_settings import strategy_config


def check_settings(settings: TrainSettings, *, verify_shards: bool = True) -> None:
    """Raise ``ConfigError`` on a strategy, model, data source or task that cannot be used.
    ``verify_shards=False`` skips hashing a prepared corpus's shards (seconds per GB): a daemon
    checking a run config on its event loop already verified them at start-up."""
    from lattica.train.engine.model_spec import check_model
    from lattica.train.engine.task import resolve_task
    from lattica.train.strategies import strategy_class

    try:
        strategy = strategy_class(settings.strategy)
    except (ValueError, KeyError) as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
    strategy_config(settings)  # the strategy's own checks (e.g. fragments dividing H)
    check_tune(settings)
    check_rank_settings(settings)  # the node's devices are there and can share the work
    if settings.task is not None:
        resolve_task(settings.task)
        return
    check_model(settings.model, settings.init)
    if strategy.trains_experts and settings.model.startswith(("llama-", "hf:")):
        raise ConfigError(f"strategy {settings.strategy} trains its own mixture-of-experts model; "
                          f"model = {settings.model!r} is not one (use diloco, sparseloco, …)")
    check_data_source(settings.data, verify_shards=verify_shards)
    check_vocabulary(settings.model, settings.data)


def check_data_source(source: str, *, verify_shards: bool = True) -> None:
    """A local data source must exist and be readable ('stdlib' and 'hf:' load later); a
    prepared corpus must be whole: its manifest valid, every shard of the size and sha256 the
    manifest gives (read in pieces, never whole)."""
    if source == "stdlib" or source.startswith("hf:"):
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"data source {source!r} does not exist")
    if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
        raise ConfigError(f"data source {source!r} is not readable")
    if path.is_file() and path.stat().st_size == 0:
        raise ConfigError(f"data source {source!r} is empty")
    from lattica.train.engine.tokenized import is_prepared, open_prepared

    if is_prepared(path):
        open_prepared(path, verify=verify_shards)


def check_vocabulary(model: str, source: str) -> None:
    """An ``hf:`` model's vocabulary must hold every id of a prepared corpus's tokenizer."""
    from lattica.train.engine import hf
    from lattica.train.engine.tokenized import is_prepared, read_manifest

    path = Path(source).expanduser()
    if not hf.is_hf_model(model) or source == "stdlib" or not is_prepared(path):
        return
    tokens = read_manifest(path)[0].vocab_size
    model_vocab = hf.hf_vocab_size(hf.read_hf_config(hf.hf_directory(model)))
    if tokens > model_vocab:
        raise ConfigError(
            f"the tokenizer of {source} has {tokens} tokens, more than the vocabulary of {model} ({model_vocab}); "
            "prepare the data with the model's own tokenizer"
        )


def check_tune(settings: TrainSettings) -> None:
    """``tune = true`` only for a strategy whose H can change at a round boundary."""
    from lattica.train.settings.retune import TUNABLE_STRATEGIES

    if settings.tune and settings.strategy not in TUNABLE_STRATEGIES:
        raise ConfigError(f"train.tune needs a strategy that syncs every H steps ({', '.join(TUNABLE_STRATEGIES)}); "
                          f"strategy {settings.strategy!r} cannot change H between rounds")
