"""The composition layer: one Lattica node, its daemon process and its services.

``node.py`` runs the libp2p host, its connectivity, the control socket and the metrics exporter
in one nursery and starts the services a ``ServiceBuilder`` builds (``services.py``: what a
service is, what it is given). ``daemon.py`` runs ``lattica join``'s node as a process;
``open_node`` (``training_node.py``) runs a node inside a training script.
"""
