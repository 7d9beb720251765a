"""Custom redistributions and kernels: blockwise attention, context parallel, MoE dispatch."""
