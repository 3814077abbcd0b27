"""kvconn: abort-safe KV-cache transfer for disaggregated LLM serving."""
