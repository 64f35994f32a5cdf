"""The inner-loop engine: models, data, tasks, the trainer and its checkpoints.

Usable without a node (``lattica.train.api.wrap``, ``benchmarks/convergence.py``): it imports
nothing of the swarm, the settings routing or the daemon, only the outer strategies it runs.
"""
