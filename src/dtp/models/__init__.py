"""Reference models, written functionally with logical axis names."""

from . import llama, sequential
from .sequential import Layer, Sequential

__all__ = ["llama", "sequential", "Layer", "Sequential"]
