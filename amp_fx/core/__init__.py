"""The converter: ``convert()``, the levels, the op tables, policy, the dtype analysis, the pass pipeline and its report.

Reading order for a newcomer: :mod:`~amp_fx.core.api` (``convert``),
:mod:`~amp_fx.core.config` (levels), :mod:`~amp_fx.core.tables` (what runs
low or fp32, with reasons), :mod:`~amp_fx.core.policy` (user overrides),
:mod:`~amp_fx.core.analysis` (every value's dtype, shape and size),
:mod:`~amp_fx.core.pipeline` (the pass order, passes in ``amp_fx.passes``),
:mod:`~amp_fx.core.report` (what was decided and why).
"""
