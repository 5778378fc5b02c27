"""Shared test set-up: make tests/zoo.py importable, seed every test, one thread."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    """Seed every test; run it on one thread (tiny models run faster, and alike on any machine)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
