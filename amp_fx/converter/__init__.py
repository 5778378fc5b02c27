"""The convert driver: ``convert()``, the pass pipeline, the report, and the converted GraphModule with its run-time state.

Reading order: :mod:`~amp_fx.converter.api` (``convert``),
:mod:`~amp_fx.converter.pipeline` (the pass order; passes in ``amp_fx.passes``),
:mod:`~amp_fx.converter.report` (what was decided and why),
:mod:`~amp_fx.converter.graph_module` (``AmpGraphModule``: hooks, buffers,
O2 masters).  The driver stands on the frontend, the passes and the IR.
"""
