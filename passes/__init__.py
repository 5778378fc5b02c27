"""Analyses and rewrites over torch.fx graphs (installed as ``amp_fx.passes``)."""
