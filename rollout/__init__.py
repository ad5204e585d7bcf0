"""The vLLM side of kimi-rl: a vLLM plugin that registers parity model implementations whose
layers call the shared kernels in `parity/` (attention included, over vLLM's paged KV cache),
the engine wrapper that samples completions and returns each sampled token's log-prob as vLLM
computed it (and takes adapter and weight syncs in memory), the Ray rollout worker, the
`rollout:` config section, and every change made to vLLM's process state (`vllm_patches.py`).

Imports: parity/ only; the trainer and the driver are never imported here.
"""
