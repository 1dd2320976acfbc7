"""specops: speculative decoding, safe to run in production on vLLM and llama.cpp."""

__version__ = "0.1.0"
