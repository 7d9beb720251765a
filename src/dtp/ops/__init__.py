"""Ops that know about placements: attention, vocab-parallel embedding and loss,
recompute policy. Custom redistributions for context parallel and MoE land here too."""

from .attention import attention, rotary
from .parallel import cross_entropy, embedding, linear
from .recompute import recompute, remat

__all__ = ["attention", "rotary", "linear", "embedding", "cross_entropy", "recompute", "remat"]
