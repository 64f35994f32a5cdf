"""The run config: the settings every member of a run must share, written by an admin.

Theory of operation: the replicated state holds one run config that only admin keys may write
(``ReplicatedState.set_run_config``; a new swarm's creator is its admin, a joiner trusts the
peers it joined through unless ``admins`` says otherwise). Before it builds its trainer, a
training member looks at it:

- none published yet, and we are an admin: publish our run-wide settings (``RUN_WIDE``) and
  train with them;
- none published yet, and an admin trains in the run: wait (at most ``wait_s``) for its config;
- a config is published and we are an admin whose run-wide settings differ: ours replace it
  (an admin extends a run by restarting with more ``rounds``), logged as an update;
- a config is published and we are no admin: train with its run-wide values, whatever ours say,
  and log each value of ours that it overrides.

The other settings (data, task, device, batch size, checkpoints, aggregation, deadline,
``min_peers``) stay each member's own; so does the folder of an ``hf:<dir>`` model (it is a
path on each machine), checked instead by the model hash below.

Once its trainer is built, a member also agrees on *what* it trains (``agree_run_identity``):
the hash of the model's description (``model_spec``: family, full config, vocabulary, init)
and the manifest hash of a prepared corpus (``train/engine/tokenized.py``; a byte-level corpus stays
each member's own). An admin adds them to the run config; any other member waits for them
(as for the config) and refuses to train, with one line naming the difference, when its own
differ — a member with another model, tokenizer or corpus would otherwise diverge silently.
Members read the config when their training starts: a member already training keeps the values
it started with. A config that does not validate (``TrainSettings``, ``check_settings``) fails
the member's training with that error, visible in ``lattica status``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import trio

from lattica.config import TrainSettings
from lattica.errors import ConfigError, LocalProtocolError
from lattica.train.swarm.membership import TRAINING_ROLES, MembershipView

log = logging.getLogger(__name__)

RUN_WIDE: tuple[str, ...] = (
    "strategy", "model", "init", "inner_steps", "rounds", "seq_len", "inner_lr", "warmup_steps",
    "outer_lr", "outer_momentum", "seed", "averaging", "group_size", "group_grace_s", "gossip_overlap",
    "first_moment_rounds", "second_moment_rounds", "staleness_penalty", "momentum_clip", "tune",
    "codec",
)
IDENTITY: tuple[str, ...] = ("model_hash", "data_hash")
KEPT: tuple[str, ...] = (*IDENTITY, "tuned")  # kept when an admin republishes (the tuned schedule: ``retune``)
_FIRST_SYNC_S = 5.0

RunConfig = dict[str, object]  # run-wide setting -> value (JSON)


def run_config_of(settings: TrainSettings) -> RunConfig:
    """The run-wide settings as a run config (unset optional values are left out)."""
    return {name: getattr(settings, name) for name in RUN_WIDE if getattr(settings, name) is not None}


def apply_run_config(settings: TrainSettings, published: Mapping[str, object]) -> tuple[TrainSettings, RunConfig]:
    """``settings`` with the run-wide values of ``published``; also the values of ours it
    replaced. An optional setting the config leaves out is unset (the strategy default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainSettings)}
    values: RunConfig = {
        name: published[name] if name in published else getattr(settings, name) if defaults[name] is not None else None
        for name in RUN_WIDE
    }
    if _is_local_model(values["model"]) and _is_local_model(settings.model):
        values["model"] = settings.model  # a folder on this machine; the model hash must agree
    adopted = dataclasses.replace(settings, **values)  # type: ignore[arg-type]  # validated again: a bad config is a ConfigError
    replaced = {name: getattr(settings, name) for name in RUN_WIDE if getattr(settings, name) != getattr(adopted, name)}
    return adopted, replaced


def published_config(view: MembershipView) -> Mapping[str, object] | None:
    config = view.run_config()
    return config if any(name in config for name in RUN_WIDE) else None


async def agree_run_config(view: MembershipView, settings: TrainSettings, *, wait_s: float) -> TrainSettings:
    """The settings to train with (see the module docstring); ``view.admins`` may write the
    run config."""
    from lattica.train.settings.settings_check import check_settings

    published = published_config(view)
    if published is not None and _differs(published, settings) and await _publish_as_admin(
        view, {**run_config_of(settings), **{k: published[k] for k in KEPT if k in published}}
    ):
        log.warning("run config updated by this admin: %s (was %s)", run_config_of(settings), published)
        return settings
    if published is None:
        try:
            await view.publish_run_config(run_config_of(settings))
            log.info("published the run config: %s", run_config_of(settings))
        except LocalProtocolError:
            # the first sync with the admins may still be under way: give it a moment, then
            # wait for as long as an admin trains (it publishes before its training starts)
            first_sync_until = trio.current_time() + min(wait_s, _FIRST_SYNC_S)
            with trio.move_on_after(wait_s):
                while published_config(view) is None and (
                    trio.current_time() < first_sync_until or _admin_trains(view)
                ):
                    with trio.move_on_after(0.5):
                        await view.wait_changed()
        published = published_config(view)
    if published is None:
        log.warning("no admin published a run config: training with this node's settings")
        return settings
    adopted, replaced = apply_run_config(settings, published)
    check_settings(adopted, verify_shards=False)  # hashed at start-up; this runs on the event loop
    for name, mine in replaced.items():
        log.warning("run config: %s = %r (this node's %r is overridden)", name, getattr(adopted, name), mine)
    return adopted


def _is_local_model(model: object) -> bool:
    return isinstance(model, str) and model.startswith("hf:")


async def agree_run_identity(
    view: MembershipView, settings: TrainSettings, identity: Mapping[str, str], *, wait_s: float,
) -> None:
    """Agree on the model and data hashes (module docstring): publish ours as an admin, else
    wait for the run's and raise ``ConfigError`` naming the first that differs."""
    ours = {name: identity.get(name, "") for name in IDENTITY}
    published = published_config(view) or {}
    kept = {k: published[k] for k in KEPT if k in published}
    if _identity_of(published) != ours and await _publish_as_admin(view, {**run_config_of(settings), **kept, **ours}):
        if _identity_of(published) != {name: "" for name in IDENTITY}:
            log.warning("run config: model and data hashes updated by this admin: %s", ours)
        return
    with trio.move_on_after(wait_s):
        while not _has_identity(published_config(view)) and _admin_trains(view):
            with trio.move_on_after(0.5):
                await view.wait_changed()
    published = published_config(view) or {}
    if not _has_identity(published):
        log.warning("no admin published the run's model and data hashes: training without comparing them")
        return
    theirs = _identity_of(published)
    for name in IDENTITY:
        if theirs[name] != ours[name]:
            raise ConfigError(_difference(name, ours[name], theirs[name]))


def _identity_of(config: Mapping[str, object]) -> dict[str, object]:
    return {name: config.get(name, "") for name in IDENTITY}


def _has_identity(config: Mapping[str, object] | None) -> bool:
    return config is not None and any(name in config for name in IDENTITY)


def _difference(name: str, ours: str, theirs: object) -> str:
    def short(value: object) -> str:
        return f"{value[:12]}…" if isinstance(value, str) and value else "none"

    if name == "model_hash":
        return (f"this member's model differs from the run's (model hash {short(ours)} here, {short(theirs)} in the "
                "run config): another preset, vocabulary, seq_len, hf: config or init; train the run's model")
    return (f"this member's data differs from the run's (prepared corpus manifest {short(ours)} here, {short(theirs)} "
            "in the run config): another corpus or tokenizer; prepare the run's corpus with the run's tokenizer")


def _differs(published: Mapping[str, object], settings: TrainSettings) -> bool:
    return {name: published[name] for name in RUN_WIDE if name in published} != run_config_of(settings)


async def _publish_as_admin(view: MembershipView, config: RunConfig) -> bool:
    """Publish ``config`` as the run config; False when this node is no admin."""
    try:
        await view.publish_run_config(config)
    except LocalProtocolError:
        return False
    return True


def _admin_trains(view: MembershipView) -> bool:
    live = set(view.live())
    return any(a in live and view.role(a) in TRAINING_ROLES for a in view.admins)
