"""pdserve engine: paged-KV inference for Hugging Face Llama-family checkpoints."""
