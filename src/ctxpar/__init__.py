"""ctxpar: exact context-parallel attention for long sequences."""

from ctxpar.attention import attention, attention_with_lse
from ctxpar.layout import ContiguousLayout, Layout, StripedLayout, ZigzagLayout, get_layout
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
    "get_layout",
    "record",
    "hybrid_rank",
]
