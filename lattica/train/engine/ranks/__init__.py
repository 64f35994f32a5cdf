"""Every accelerator of a node: one rank process per local device, one swarm member per node.

``devices`` resolves ``train.devices`` on this machine; ``trainer.RankedTrainer`` keeps the
node's replica in the daemon and runs the inner steps on the ranks; ``group.LocalGroup``
starts, orders and watches the rank processes; ``worker`` is a rank (DDP over
``torch.distributed``: NCCL on CUDA, gloo on the CPU, on loopback); ``weights`` is the shared
buffer the weights cross by and ``messages`` the framing of the orders and answers.
"""
