"""The model: the Llama-family decoder over the pool, its tokenizer, the sampler and the runner of one step."""
