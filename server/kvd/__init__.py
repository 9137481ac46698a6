"""kvd: a KV-cache memory daemon for LLM serving."""

__version__ = "0.1.0"
