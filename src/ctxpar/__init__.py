"""ctxpar: exact context-parallel attention for long sequences."""

from ctxpar.attention import attention, attention_with_lse
from ctxpar.layout import (BalancedLayout, ContiguousLayout, Layout, StripedLayout, ZigzagLayout, balanced_layout,
                           get_layout)
from ctxpar.profile import record
from ctxpar.topology import hybrid_rank

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_with_lse",
    "Layout",
    "ContiguousLayout",
    "ZigzagLayout",
    "StripedLayout",
    "BalancedLayout",
    "balanced_layout",
    "get_layout",
    "record",
    "hybrid_rank",
]
