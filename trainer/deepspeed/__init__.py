"""The DeepSpeed room: the HF transformers model with the parity modules swapped in
(`model.py`), peft LoRA on it (`lora.py`), DeepSpeed ZeRO around it (`engine.py`), the
DeepSpeedPolicyTrainer (`policy.py`: trainer.step on this model, data-parallel ranks), its
checkpoints inside trainer.checkpoint's layout (`checkpoint.py`), the Ray trainer worker
(`worker.py`) and the backend entry trainer.backend resolves (`backend.py`: the actor class,
scoring, the DeepSpeed JSON check).

Imports: parity/ and trainer's shared modules only, never trainer/megatron/.
"""
