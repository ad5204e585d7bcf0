"""The parity layer: one implementation of every numerically relevant operation (linear,
RMSNorm, RoPE, SiLU-and-mul, causal GQA attention, embedding, log-softmax), written so that a
token's result never depends on the batch it travels in, and used unchanged by both the vLLM
rollout model and the Megatron trainer. Also the checker that proves it: it compares rollout
and trainer log-probs bit for bit and writes the report."""
