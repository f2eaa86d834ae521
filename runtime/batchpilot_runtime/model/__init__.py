"""The model: a Llama-architecture decoder in PyTorch (config, step input, attention, layers, checkpoint I/O),
its paged KV cache, sampling, tokenizer and device choice."""
