"""Lattica: a decentralized, cross-internet training runtime."""

__version__ = "0.1.0"
