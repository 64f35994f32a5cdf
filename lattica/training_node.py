"""``open_node``'s public import path: ``from lattica.training_node import open_node``.

The node a training script runs is composition, so its code lives in the composition layer
(``lattica.node.training_node``); this module keeps the documented name.
"""

from lattica.node.training_node import TrainingNode, open_node

__all__ = ["TrainingNode", "open_node"]
