"""CP attention strategies: each moves K/V (or heads) differently, all compute the same thing."""

from ctxpar.strategies.ring import ring_attention

STRATEGIES = {"ring": ring_attention}

__all__ = ["STRATEGIES", "ring_attention"]
