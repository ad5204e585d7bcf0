"""The Megatron-core side of kimi-rl: a GPTModel built from an HF checkpoint with the parity
kernels plugged in through a layer spec, HF <-> Megatron conversion (through parity/weights.py),
the CPU shims that megatron-core 0.16.1 needs (one module), the function that scores token
sequences into per-token log-probs, LoRA, the PPO math (`ppo.py`) and the PPO / GRPO / RLOO step
that uses it (`policy.py`), checkpoints, the config sections it owns (`trainer:`, `lora:`,
`algorithm:`, `checkpoint:`), and the Ray trainer worker. Nothing here imports vLLM.

Imports: parity/ only; vLLM and the driver are never imported here.
"""

import warnings

# megatron-core 0.16.1 warns at import that Transformer Engine / Apex are absent and that a
# config default is deprecated; the trainer uses neither TE nor Apex by design.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
