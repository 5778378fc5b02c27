"""Training runtime: dynamic loss scaling and fp32 master weights."""

from .distributed import convert_for_sharding
from .loss_scaler import LossScaleCollapseError, LossScaler
from .master_weights import MasterWeightOptimizer
from .masterless import LowPrecisionOptimizer
from .scaler_state import LossScalerStateError

__all__ = [
    "LossScaler",
    "LossScaleCollapseError",
    "LossScalerStateError",
    "MasterWeightOptimizer",
    "LowPrecisionOptimizer",
    "convert_for_sharding",
]
