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
from lattica.train.strategy_settings import strategy_config


def check_settings(settings: TrainSettings) -> None:
    """Raise ``ConfigError`` on a strategy, model, data source or task that cannot be used."""
    from lattica.train.model import preset
    from lattica.train.strategies import strategy_class
    from lattica.train.task import resolve_task

    try:
        strategy_class(settings.strategy)
        if settings.task is None:
            preset(settings.model)
    except (ValueError, KeyError) as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
    strategy_config(settings)  # the strategy's own checks (e.g. fragments dividing H)
    if settings.task is not None:
        resolve_task(settings.task)
    else:
        check_data_source(settings.data)


def check_data_source(source: str) -> None:
    """A local data source must exist and be readable ('stdlib' and 'hf:' load later)."""
    if source == "stdlib" or source.startswith("hf:"):
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"data source {source!r} does not exist")
    if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
        raise ConfigError(f"data source {source!r} is not readable")
    if path.is_file() and path.stat().st_size == 0:
        raise ConfigError(f"data source {source!r} is empty")
