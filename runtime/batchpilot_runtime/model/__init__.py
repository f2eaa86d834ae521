"""The model: a Llama-architecture decoder in PyTorch (config, step input, attention, layers, checkpoint I/O:
safetensors directories, GGUF files and named models), its paged KV cache, sampling, tokenizer and device choice."""
