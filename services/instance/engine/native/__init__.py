"""The native engine: a Llama-family decoder in plain PyTorch over a paged KV cache."""
