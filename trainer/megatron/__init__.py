"""The Megatron room: the megatron-core GPTModel with the parity kernels plugged in by layer
spec (`model.py`, `layers.py`; kimi-mini in `kimi.py`), HF <-> Megatron conversion through
parity/weights.py (`convert.py`), LoRA (`lora.py`), log-prob scoring (`logprobs.py`), the
megatron-core CPU shims (`patches.py`), the PolicyTrainer (`policy.py`: trainer.step on this
model), the Ray trainer worker (`worker.py`) and the backend entry trainer.backend resolves
(`backend.py`: the actor class and tensor-parallel scoring).

Imports: parity/ and trainer's shared modules only, never trainer/deepspeed/.
"""

import warnings

# megatron-core 0.16.1 warns at import that Transformer Engine / Apex are absent and that a
# config default is deprecated; the trainer uses neither TE nor Apex by design.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
