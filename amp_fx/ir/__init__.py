"""The IR every pass stands on: node metadata, op properties, the dtype analysis and the pass contract.

Reading order: :mod:`~amp_fx.ir.meta` (every ``node.meta`` key, with typed
accessors), :mod:`~amp_fx.ir.op_keys` and :mod:`~amp_fx.ir.tables` (canonical
op names and what runs low or fp32, with reasons), :mod:`~amp_fx.ir.op_properties`
(everything else a pass asks about an op: views, rounding, GEMMs, casts, ...; a library's
row checked against its op by :mod:`~amp_fx.ir.gemm_rows`),
:mod:`~amp_fx.ir.analysis`
(every value's dtype, shape and aliasing in the rewritten program; with
:mod:`~amp_fx.ir.fake_calls` and :mod:`~amp_fx.ir.aliasing`),
:mod:`~amp_fx.ir.pass_manager` (the pass contract and its runner; its checks in
:mod:`~amp_fx.ir.pass_checks`).  It imports
only :mod:`amp_fx.errors` and :mod:`amp_fx.graph_ops`.
"""
