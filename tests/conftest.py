"""Fixtures shared by test folders."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def wide_umask():
    """The usual default umask (files 0644, folders 0755), restored afterwards."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)
