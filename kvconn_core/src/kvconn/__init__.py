"""kvconn: abort-safe KV-cache transfer for disaggregated LLM serving."""

#: This distribution's version: the one source its metadata (pyproject.toml) reads.
__version__ = "0.1.0"
