"""The model: a Llama-architecture decoder in PyTorch, its paged KV cache, sampling, tokenizer and device choice."""
