"""Draft heads (EAGLE-1/2/3, Medusa): their config and compatibility check, layers, checkpoint
formats (turbospec's own and the public layouts) and the heads shipped in the package."""
from .config import HeadConfig, check_head_compatible

__all__ = ["HeadConfig", "check_head_compatible"]
