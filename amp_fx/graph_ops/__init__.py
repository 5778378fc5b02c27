"""What a converted graph calls at run time: casts, the weight-cast cache, fused norms, hook boundaries, O2 master sync.

The floor under the IR: these are the call targets the IR's nodes name, so
they import nothing of amp_fx but :mod:`amp_fx.errors`.
"""
