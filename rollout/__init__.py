"""The vLLM side of kimi-rl: a vLLM plugin that registers parity model implementations whose
layers call the shared kernels in `parity/` (attention included, over vLLM's paged KV cache),
an engine wrapper that samples completions and returns each sampled token's log-prob as vLLM
computed it (and takes adapter and weight syncs in memory), the Ray rollout worker, and the
sync wire format. Nothing here imports the trainer."""
