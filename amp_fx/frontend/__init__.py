"""Tracing real model code faithfully: symbolic tracing, torch.export for Hugging Face models, and the constructs that must stay as written.

:mod:`~amp_fx.frontend.tracing` picks the route; the other modules each keep
one construct's meaning through the trace (autocast regions, custom autograd
Functions, checkpointing, ``self.training``, export's dtype checks).
"""
