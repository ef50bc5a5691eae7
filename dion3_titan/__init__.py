"""dion3_titan: the Dion3 optimizer for torchtitan."""

from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.dion3 import Dion3

__all__ = ["Dion3", "Dion3Config"]
