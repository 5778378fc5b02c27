"""The ``torch.compile`` backend: ``torch.compile(model, backend="amp_fx")`` converts each graph Dynamo captures.

:mod:`~amp_fx.dynamo.backend` is the entry point (``amp_fx.backend(...)``),
:mod:`~amp_fx.dynamo.graph` reads Dynamo's graphs, :mod:`~amp_fx.dynamo.bodies`
converts higher-order-op bodies, :mod:`~amp_fx.dynamo.report` merges reports,
:mod:`~amp_fx.dynamo.watch` warns when Dynamo left nothing to convert,
:mod:`~amp_fx.dynamo.between_graphs` decides the ops Dynamo runs eagerly between graphs.
"""
