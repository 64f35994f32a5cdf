"""The tensor data plane: codecs, framing, the fast channel, transfers and collectives.

Importing this package imports torch; ``lattica.net`` itself never imports it.
"""

from lattica.net.tensors.collectives import CollectiveAbortedError
from lattica.net.tensors.limits import TensorLimits
from lattica.net.tensors.transfer import TENSOR_PROTOCOL, TensorService, TensorServiceConfig

__all__ = [
    "TENSOR_PROTOCOL",
    "CollectiveAbortedError",
    "TensorLimits",
    "TensorService",
    "TensorServiceConfig",
]
