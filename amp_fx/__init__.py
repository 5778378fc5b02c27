"""amp_fx: automatic mixed precision for PyTorch as a torch.fx graph rewrite.

``amp_fx.convert(model, level="O1")`` traces the model, decides each node's
precision from allow / deny / promote tables, inserts explicit casts, and
returns a GraphModule with a report of every decision.
"""

from amp_fx.api import convert
from amp_fx.config import AmpConfig, LEVELS
from amp_fx.errors import AlreadyConvertedError, AmpError, BannedOpError, UnknownOpError
from amp_fx.graph_module import AmpGraphModule
from amp_fx.policy import Policy
from amp_fx.report import ConversionReport, NodeRecord
from amp_fx.tracing import AmpTraceError

__all__ = [
    "convert",
    "AmpConfig",
    "LEVELS",
    "Policy",
    "AmpGraphModule",
    "ConversionReport",
    "NodeRecord",
    "AmpError",
    "AmpTraceError",
    "BannedOpError",
    "UnknownOpError",
    "AlreadyConvertedError",
]
