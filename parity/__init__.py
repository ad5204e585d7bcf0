"""The parity layer, the ground floor: one implementation of every numerically relevant
operation (linear, RMSNorm, RoPE, SiLU-and-mul, causal GQA attention, embedding, log-softmax,
kimi-mini's KDA / MLA / MoE math), written so that a token's result never depends on the batch it
travels in, and used unchanged by the vLLM rollout model and the Megatron trainer; with what both
sides must agree on: the model specs and the architecture registry (`model_spec.py`), the one
name map per architecture (`weights.py`), the fused layouts, LoRA math, TP shards, dtypes, the
sync wire format, tensor checksums and the log-prob comparison.

Imports: nothing of ours (torch, transformers and the standard library only).
"""
