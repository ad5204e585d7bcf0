"""The Megatron-core side of kimi-rl: a GPTModel built from an HF checkpoint with the parity
kernels plugged in through a layer spec, HF <-> Megatron weight conversion, the CPU shims that
megatron-core 0.16.1 needs (one module), and the function that scores token sequences into
per-token log-probs. Nothing here imports vLLM."""
