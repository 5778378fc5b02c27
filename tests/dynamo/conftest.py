"""Every backend test starts and ends with a fresh Dynamo: compiled code from one test never serves another."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
