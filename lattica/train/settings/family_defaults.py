"""Strategy defaults per model family, where one default cannot serve every model.

A strategy's config class holds the defaults tuned with the byte-level GPT (``tiny``) on the
standard library's sources (docs/strategies.md). Measured with ``llama-tiny`` on two corpora
prepared with a BPE tokenizer, some of them lose what they were chosen for — DiLoCo's η 0.7
ties with training alone on English prose, while η 0.5 is ahead on both corpora and 1–1.4 %
worse on the byte-level GPT; SparseLoCo's 1.59 % at α 2.75 falls behind training alone, where
10 % at α 1.75 is the best setting measured — so a Llama preset runs with its own values of
those fields (docs/strategies.md, "Llama-tiny on two tokenized corpora").

``FAMILY_DEFAULTS`` lists, per model family and strategy, only the fields that differ from the
config class. ``strategy_settings.strategy_config`` starts from them and then applies what the
run settings set, so a value the user sets explicitly always wins. The family comes from the
``model`` setting alone (``model_spec.model_family``), the same on every member; a run with a
user ``task`` (its own model, family unknown), a GPT preset and an ``hf:`` model keep the config
class's defaults: nothing was measured on the others.
"""

from __future__ import annotations

from collections.abc import Mapping

# family -> strategy -> config field -> value (the fields the config class's default does not serve)
FAMILY_DEFAULTS: Mapping[str, Mapping[str, Mapping[str, object]]] = {
    "llama": {
        "diloco": {"outer_lr": 0.5},
        "sparseloco": {"density": 0.10, "outer_lr": 1.75},
    },
}


def run_model_family(model: str, task: str | None) -> str | None:
    """The family of the run's model: None when a user ``task`` builds its own."""
    if task:
        return None
    from lattica.train.engine.model_spec import model_family

    return model_family(model)


def family_defaults(strategy: str, family: str | None) -> dict[str, object]:
    """The config fields of ``strategy`` whose default differs for models of ``family``."""
    if family is None:
        return {}
    return dict(FAMILY_DEFAULTS.get(family, {}).get(strategy, {}))


def family_defaults_help() -> str:
    """One line per family for ``lattica join --help`` (``cli/main.py`` keeps it as text)."""
    parts = []
    for family, strategies in FAMILY_DEFAULTS.items():
        fields = "; ".join(
            f"{strategy} " + ", ".join(f"{name} {value}" for name, value in values.items())
            for strategy, values in strategies.items()
        )
        parts.append(f"{family} presets: {fields}")
    return "defaults that differ by model family (set explicitly, a value wins): " + " | ".join(parts)
