"""Training frameworks with amp_fx in one line: Lightning, Hugging Face Trainer, Accelerate.

Each integration is its own module, imported on use, and needs its framework's optional extra
(``pip install amp_fx[lightning]``, ``[hf]``, ``[accelerate]``); ``import amp_fx`` never imports a framework.
"""

_MODULES = frozenset({"lightning", "hf", "accelerate"})


def __getattr__(name: str):
    # ``amp_fx.integrations.lightning.AmpFxPrecision`` after ``import amp_fx`` alone: the framework is
    # imported on this first access, not before.
    if name in _MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
