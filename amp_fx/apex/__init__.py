"""Apex's ``amp`` API on amp_fx: ``initialize``, ``scale_loss``, ``state_dict`` and friends, for porting Apex scripts unchanged."""

from amp_fx.apex.amp import *  # noqa: F401,F403  (the API lives in amp.py)
from amp_fx.apex.amp import __all__  # noqa: F401
