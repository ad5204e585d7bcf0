"""The trainer side of kimi-rl, one room per backend and the code they share.

Shared (this folder): the interface the driver uses (`backend.py`: a backend by name, its Ray
actor, its scoring), the PPO / GRPO / RLOO step both backends run (`step.py`) with its math
(`ppo.py`), the checkpoint format (`checkpoint.py`), the config sections this side owns
(`config.py`: `trainer:`, `lora:`, `algorithm:`, `checkpoint:`) and a torch.distributed helper
(`distributed.py`).

Rooms: `megatron/` (the megatron-core GPTModel with the parity kernels plugged in, the default)
and `deepspeed/` (the HF transformers parity model under DeepSpeed ZeRO). A room imports the
shared modules and never the other room; the shared modules import no room (trainer.backend
names them as strings, imported on first use). Nothing here imports vLLM.

Imports: parity/ only; vLLM and the driver are never imported here.
"""
