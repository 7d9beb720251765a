"""Reference models, written functionally with logical axis names."""

from . import llama

__all__ = ["llama"]
