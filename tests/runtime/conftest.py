"""Fixtures for the runtime tests."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountHostSyncs(TorchDispatchMode):
    """Count device-to-host reads (``.item()``, ``bool(tensor)``) dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count_host_syncs():
    """Return the CountHostSyncs mode class: ``with count_host_syncs() as c: ...; c.count``."""
    return CountHostSyncs
