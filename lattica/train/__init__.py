"""Training: ``engine/`` (the inner loop, models, data, checkpoints; usable without a node),
``strategies/`` (the outer-step math), ``settings/`` (from run settings to a trainer), ``swarm/``
(a trainer among its peers), and the daemon's training service (``service``, ``status``,
``ports``); ``api.wrap`` for a user's own loop. docs/architecture.md has the rules.

Imports nothing: a daemon that does not train reads the membership view (``swarm/``) without
loading the training stack.
"""
