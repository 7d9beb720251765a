"""Ops that know about placements: attention, vocab-parallel embedding and loss,
recompute policy; the custom redistributions of context parallel (``ops.context``) and of
expert parallel (``ops.moe_dispatch``: dispatch / combine)."""

from . import moe_dispatch
from .attention import attention, rotary
from .local_batch import batch_local
from .parallel import IGNORE_INDEX, add_bias, count_targets, cross_entropy, embedding, linear, mean_over
from .norms import rms_norm
from .recompute import recompute, remat
from .vocab import mask_padded_vocab

__all__ = ["moe_dispatch", "attention", "rotary", "linear", "add_bias", "embedding", "cross_entropy",
           "count_targets", "mean_over", "IGNORE_INDEX", "recompute", "remat", "mask_padded_vocab",
           "rms_norm", "batch_local"]
