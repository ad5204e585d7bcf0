"""The vLLM side of kimi-rl: a vLLM plugin that registers parity model implementations whose
layers call the shared kernels in `parity/` (attention included, over vLLM's paged KV cache),
and an engine wrapper that samples completions and returns each sampled token's log-prob as
vLLM computed it. Nothing here imports the trainer."""
