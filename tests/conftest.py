"""Shared test set-up: make tests/zoo.py and tests/ranks.py importable, seed every test, one thread, fresh Dynamo."""

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


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Start and end every test with a fresh Dynamo: compiled code from one test never serves another.

    Why every test, not only tests/dynamo: Dynamo counts recompilations per code object across the whole process.
    Code that many Hugging Face models share (transformers' ``deprecate_kwarg`` wrapper around their forwards)
    reached ``recompile_limit`` after enough tests had compiled models through it, and from then on Dynamo ran those
    frames eagerly -- so a later test's ``torch.compile(backend="amp_fx")`` silently ran fp32 and failed on that.
    """
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
