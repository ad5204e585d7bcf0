"""DeepSpeed around the HF parity model (trainer.deepspeed.model): one data-parallel rank.

- `init_distributed`: torch.distributed through DeepSpeed, gloo on the CPU, NCCL on GPUs; every
  rank is its own process (Ray actors or torch.multiprocessing, see trainer.deepspeed.worker).
- `deepspeed_config`: the DeepSpeed config kimi-rl runs: ZeRO stage from the settings (default
  2) or from a user's DeepSpeed JSON (by path), whose ZeRO / offload / communication sections
  are used as given. kimi-rl owns the batch bookkeeping (it drives gradient accumulation
  itself: one `step()` per minibatch), the precision (bf16 iff the model is bf16; fp16 is
  refused: the parity kernels compute in fp32 or bf16) and the optimizer.
- `build_optimizer`: torch AdamW or DeepSpeedCPUAdam (JIT-built on first use, cached under
  `extensions_dir` or $TORCH_EXTENSIONS_DIR, never the home directory).
- `DeepSpeedModel`: the engine plus what a trainer asks of it: forward, backward with the
  accumulation boundary, step (clipping and the gradient norm are DeepSpeed's, over every
  trainable parameter), parameters gathered for a weight sync (ZeRO-3 partitions them;
  `deepspeed.zero.GatheredParameters`), and checkpoints through DeepSpeed's save/load.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Keys kimi-rl sets itself; a user's JSON that sets them differently is refused with the reason.
_OWNED = {
    "train_batch_size": "kimi-rl drives gradient accumulation itself (one step per minibatch)",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_size sets the micro-batch",
    "gradient_accumulation_steps": "kimi-rl drives gradient accumulation itself (one step per minibatch)",
    "gradient_clipping": "trainer.grad_clip sets it",
    "optimizer": "trainer.deepspeed.optimizer and trainer.lr / betas / eps / weight_decay set it",
    "scheduler": "kimi-rl runs a constant learning rate",
    "fp16": "the parity kernels compute in fp32 or bf16 (model.dtype)",
}


@dataclass(frozen=True)
class EngineSettings:
    zero_stage: int = 2
    config_path: str | None = None  # a DeepSpeed JSON; its zero_optimization stage wins
    optimizer: str = "adamw"  # "adamw" | "deepspeed_cpu_adam"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0: no clipping
    extensions_dir: str | None = None  # deepspeed_cpu_adam's JIT build cache


def _quiet() -> None:
    """DeepSpeed's accelerator, log level and comm backend set up for kimi-rl (before any
    deepspeed.init_distributed, ours or the one deepspeed.initialize makes)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import importlib

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # deepspeed 0.19.8's ZeRO calls torch.distributed collectives that torch 2.13 deprecates
    # (a FutureWarning on every ZeRO-3 gather): DeepSpeed's to change, not the user's.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)
    # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op when its comm backend
    # starts (~30 s, a C++ compiler, a kernel chosen by the CPU's ISA) that only its inference
    # all-reduce uses; ZeRO's collectives go through torch.distributed. Not built, not used.
    # (deepspeed.comm's attribute "torch" is the torch package, hence import_module.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def init_distributed(rank: int, world_size: int, master_port: int, master_addr: str = "127.0.0.1") -> None:
    """torch.distributed for this rank (gloo on the CPU, NCCL on GPUs), through DeepSpeed."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank if torch.cuda.is_available() else 0),
        WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
    )
    _quiet()
    import deepspeed

    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               auto_mpi_discovery=False, verbose=False)


def read_user_config(path: str | Path) -> dict[str, Any]:
    """A user's DeepSpeed JSON (ValueError naming the file and line, or the key, when bad)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such DeepSpeed config file")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object")
    for key, why in _OWNED.items():
        if key in config and not (key == "fp16" and not config[key].get("enabled", False)):
            raise ValueError(f"{path}: remove {key!r}: {why}")
    bf16 = config.get("bf16", {})
    if "enabled" in bf16 and not isinstance(bf16["enabled"], bool):
        raise ValueError(f"{path}: bf16.enabled must be true or false")
    stage = config.get("zero_optimization", {}).get("stage")
    if stage is not None and stage not in (0, 1, 2, 3):
        raise ValueError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return config


def deepspeed_config(settings: EngineSettings, dtype: str) -> dict[str, Any]:
    """The config passed to deepspeed.initialize (see the module docstring)."""
    config = read_user_config(settings.config_path) if settings.config_path else {}
    config = copy.deepcopy(config)
    bf16 = dtype == "bf16"
    if config.get("bf16", {}).get("enabled", bf16) != bf16:
        raise ValueError(f"{settings.config_path}: bf16.enabled must match model.dtype {dtype}")
    config["bf16"] = {**config.get("bf16", {}), "enabled": bf16}
    zero = config.setdefault("zero_optimization", {})
    zero.setdefault("stage", settings.zero_stage)
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    if offload and settings.optimizer != "deepspeed_cpu_adam":
        raise ValueError(f"{settings.config_path}: zero_optimization.offload_optimizer needs "
                         "trainer.deepspeed.optimizer: deepspeed_cpu_adam")
    config.update(
        # Bookkeeping only: kimi-rl calls step() once per minibatch and marks the boundary.
        train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
        gradient_clipping=settings.grad_clip, steps_per_print=2**31 - 1,
    )
    config.setdefault("wall_clock_breakdown", False)
    return config


def build_optimizer(groups: list[dict], settings: EngineSettings) -> torch.optim.Optimizer:
    kwargs = dict(betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay)
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=settings.lr, **kwargs)
    if settings.optimizer != "deepspeed_cpu_adam":
        raise ValueError(f"optimizer must be adamw or deepspeed_cpu_adam, got {settings.optimizer!r}")
    cache = settings.extensions_dir or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not cache:
        raise ValueError("deepspeed_cpu_adam JIT-builds a C++ op: give it a cache directory "
                         "(the run dir does, or set TORCH_EXTENSIONS_DIR)")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(cache)  # read by torch's cpp_extension at build
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, lr=settings.lr, adamw_mode=True, **kwargs)


def register_external_weights(module: nn.Module) -> None:
    """ZeRO-3: the parity attention / MLP modules read their children's weights without
    running the children (trainer.deepspeed.model), so each weight is registered as an external
    parameter of the module that reads it: ZeRO gathers it when that module starts.

    Not ZeRO-3 leaf modules: a leaf's gradients are reduced in a module backward hook, which
    fires before the module's backward when the module is called with keyword tensors only
    (HF's decoder layer calls its attention so), and then finds no gradients."""
    import deepspeed

    from trainer.deepspeed.model import FUSED_READERS, FUSED_RUN_AS_MODULES

    for owner in module.modules():
        if isinstance(owner, FUSED_READERS):
            for child in owner.children():
                if not isinstance(child, FUSED_RUN_AS_MODULES):
                    for p in child.parameters():
                        deepspeed.zero.register_external_parameter(owner, p)


class DeepSpeedModel:
    """`module` (every parameter with requires_grad trains; `groups` are the optimizer's param
    groups over them) inside a DeepSpeed engine on this rank (init_distributed first)."""

    def __init__(self, module: nn.Module, groups: list[dict], settings: EngineSettings, dtype: str) -> None:
        _quiet()
        import deepspeed

        self.config = deepspeed_config(settings, dtype)
        self.zero_stage = int(self.config["zero_optimization"]["stage"])
        if self.zero_stage == 3:
            register_external_weights(module)
        optimizer = build_optimizer(groups, settings)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=self.config,
        )
        self.module = self.engine.module

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Accumulate this micro-batch's gradients; `boundary` on the minibatch's last one
        (every rank runs the same number of backward calls: ZeRO reduces inside them)."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)

    def step(self) -> float:
        """One optimizer step on the accumulated gradients (clipped by DeepSpeed to
        gradient_clipping); returns the global gradient norm before clipping."""
        self.engine.set_gradient_accumulation_boundary(True)
        if self.zero_stage == 0 and not self.config["bf16"]["enabled"]:
            # DeepSpeed 0.19.8 clips an fp32 model without ZeRO through its clip_grad_norm_
            # and drops the norm (get_global_grad_norm() stays None): take it here, from the
            # gradients already averaged over the ranks.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            self.engine.step()
            return norm
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def gathered(self, params: list[nn.Parameter]):
        """Context in which `params` hold their full tensors on every rank (collective under
        ZeRO-3, where each rank holds a partition; a no-op below it)."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def save(self, directory: str | Path, client_state: dict[str, Any], frozen: bool) -> None:
        """DeepSpeed's checkpoint (module, optimizer and ZeRO partitions of every rank) plus
        `client_state`; collective. frozen=False leaves out frozen weights (a LoRA base)."""
        self.engine.save_checkpoint(str(directory), tag="deepspeed", client_state=client_state,
                                    save_latest=False, exclude_frozen_parameters=not frozen)

    def load(self, directory: str | Path) -> dict[str, Any]:
        """Restore a `save` checkpoint on every rank; returns its client_state."""
        path, client_state = self.engine.load_checkpoint(
            str(directory), tag="deepspeed", load_module_strict=False,
        )
        if path is None:
            raise ValueError(f"{directory}: no DeepSpeed checkpoint (tag 'deepspeed')")
        return client_state


def scoring_model(
    model_dir: str | Path, dtype: str, zero_stage: int = 2,
    adapter: tuple[dict[str, torch.Tensor], int, float, list[str]] | None = None,
) -> DeepSpeedModel:
    """The deepspeed backend's model for re-scoring (`kimi-rl parity check --trainer
    deepspeed`): the HF parity model, with `adapter` (peft tensors, rank, alpha, targets)
    attached through peft, inside a DeepSpeed engine of ZeRO stage `zero_stage` on this rank."""
    from parity.model_spec import load_spec
    from trainer.deepspeed import lora as hf_lora
    from trainer.deepspeed.model import load_hf_model

    model = load_hf_model(model_dir, dtype)
    if adapter is not None:
        tensors, rank, alpha, targets = adapter
        model = hf_lora.apply_lora(model, load_spec(model_dir), rank, alpha, list(targets))
        hf_lora.load_peft_state_dict(model, tensors)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return DeepSpeedModel(model.eval(), [{"params": trainable}], EngineSettings(zero_stage=zero_stage), dtype)
