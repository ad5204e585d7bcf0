"""The Megatron backend's trainer as a Ray actor: a PolicyTrainer (Megatron model + LoRA +
optimizer) in its own process, with torch.distributed (gloo on the CPU, NCCL on GPUs) and
Megatron's parallel state. Its calls are trainer.backend.TrainerWorker's."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from parity.sampling import Sampling
from parity.wire import Packed, packed
from trainer.config import AlgorithmConfig, LoraConfig, TrainerConfig


class TrainerWorker:
    """One trainer rank. At trainer.tensor_parallel_size x trainer.data_parallel_size = N the
    driver starts N of these (rl.cluster.TrainerGroup) with the same arguments, ranks 0..N-1
    and one rendezvous (trainer.distributed.Rendezvous), and calls every method on every rank; rank 0's result is the one
    used (every rank ends a step with the same state: the gradients are gathered, not split)."""

    def __init__(
        self, model_path: str, dtype: str, *, parity: bool, lora: LoraConfig,
        trainer: TrainerConfig, algorithm: AlgorithmConfig, seed: int,
        sampling: Sampling | None = None, rank: int = 0, rendezvous=None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        from trainer.megatron.patches import init_megatron
        from trainer.megatron.policy import PolicyTrainer

        # megatron-core 0.16.1's TP gathers call torch's all_gather_into_tensor, which torch
        # 2.13 marks deprecated: one FutureWarning per call, in every step's log otherwise.
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated", category=FutureWarning)
        size = trainer.tensor_parallel_size * trainer.data_parallel_size
        n = max(1, (os.cpu_count() or 1) // size)  # a share of the cores per rank, as vLLM's TP
        os.environ["OMP_NUM_THREADS"] = str(n)
        torch.set_num_threads(n)
        init_world(rank, size, rendezvous)
        # Megatron's default rank order puts a TP group's ranks next to each other: rank r is
        # TP rank r % TP of data-parallel rank r // TP.
        init_megatron(tp_size=trainer.tensor_parallel_size, seed=seed)
        self.rank = rank
        self.lora = lora
        self.policy = PolicyTrainer(
            model_path, dtype, parity=parity, lora=lora, trainer=trainer, algorithm=algorithm,
            seed=seed, sampling=sampling, kv_cache_dtype=kv_cache_dtype,
        )

    def rollout_tensors(self) -> dict[str, torch.Tensor]:
        return self.policy.rollout_tensors()

    def rollout_packed(self) -> tuple[Packed | None, float | None]:
        """rollout_tensors in the sync wire format (parity.wire), packed and hashed once here and
        put in Ray's object store: the driver gets the handle, digest and size (and the LoRA
        scaling, which saves it a call), the workers read the buffer from the store. Every rank
        computes the tensors (a collective under TP); rank 0 alone packs them."""
        import ray

        tensors = self.policy.rollout_tensors()
        if self.rank != 0:
            return None, None
        return packed(tensors, store=ray.put), self.policy.lora_scaling

    def rollout_params(self) -> dict[str, torch.Tensor]:
        """Full weights (no LoRA) under the rollout parity model's parameter names, in the
        fused layouts both sides hold: a full-weight sync copies them without repacking."""
        from trainer.megatron.convert import megatron_to_rollout

        state = {k: v.detach() for k, v in self.policy.model.state_dict().items() if torch.is_tensor(v)}
        return {k: v.contiguous() for k, v in megatron_to_rollout(state, self.policy.spec).items()}

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Full HF weights with the adapter merged in (W + scaling * B @ A, in fp32, then cast):
        what a stock vLLM engine gets when parity is off — the usual way frameworks hand a
        LoRA policy to vLLM, and one of the sources of the mismatch parity removes."""
        from trainer.megatron.convert import megatron_to_hf

        model = self.policy.model
        dtype = model.embedding.word_embeddings.weight.dtype
        base = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and "lora" not in k
                and not k.endswith("_extra_state")}
        weights = megatron_to_hf(base, self.policy.spec)
        adapter = self.policy.rollout_tensors() if self.lora.enabled else {}
        scaling = self.policy.lora_scaling or 0.0
        for key, a in adapter.items():
            if ".lora_A." not in key:
                continue
            b = adapter[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            merged = weights[name].float() + scaling * (b.float() @ a.float())
            weights[name] = merged.to(dtype)
        return {k: v.detach().to(dtype).contiguous() for k, v in weights.items()}

    def lora_scaling(self) -> float | None:
        return self.policy.lora_scaling

    def logprobs(self, sequences: list[list[int]], starts: list[int], raw: bool = False) -> list[torch.Tensor]:
        return self.policy.logprobs(sequences, starts, raw)

    def old_logprobs(self, batch: dict) -> list[torch.Tensor]:
        """The old-policy log-probs of the batch's sampled tokens, before any update: the
        driver compares them bit for bit with the rollout's and then calls train_step."""
        return self.policy.logprobs(batch["sequences"], batch["starts"])

    def train_step(self, batch: dict, old_logprobs: list[torch.Tensor]) -> dict:
        """{"stats", "skipped"}: the update, unless its loss or gradients are not finite;
        then the trainer's state is restored as it was before the step (adapter, optimizer,
        RNG) and "skipped" names the non-finite stats."""
        return guarded_train_step(self.policy, batch, old_logprobs)

    def save_checkpoint(self, run_dir: str, step: int, extra: dict, keep: int) -> str:
        """Rank 0 writes (every rank holds the same replicated adapter and optimizer state, so
        the checkpoint is the TP=1 one and resumes at any TP size); the others write nothing."""
        from trainer.checkpoint import save_checkpoint, step_dir_name

        if self.rank != 0:
            return str(Path(run_dir) / "checkpoints" / step_dir_name(step))
        return str(save_checkpoint(Path(run_dir), step, self.policy, extra, keep=keep))

    def load_checkpoint(self, path: str) -> dict:
        from trainer.checkpoint import load_checkpoint

        return load_checkpoint(Path(path), self.policy)


def init_world(rank: int = 0, size: int = 1, rendezvous=None) -> None:
    """torch.distributed for this trainer's ranks. They meet through `rendezvous`: in a run, a
    trainer.distributed.Rendezvous actor (ranks on any nodes of the Ray cluster); without Ray, a
    file path the ranks share (one host); None for a world of one. The collectives' own sockets
    (gloo, NCCL's bootstrap) go on the interface holding this node's Ray address: loopback in a
    local run, the node's address in a cluster. No TCPStore: it listens on every interface."""
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.distributed import RayStore, interface_of

    timeout = timedelta(minutes=10)
    if rendezvous is None or isinstance(rendezvous, str):
        interface = "lo"
        path = rendezvous or os.path.join(tempfile.mkdtemp(prefix="kimi-rl-store-"), "store")
        store = dist.FileStore(path, size)
    else:
        import ray

        interface = interface_of(ray.util.get_node_ip_address())
        store = RayStore(rendezvous, timeout)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = interface
    # A rank that fails leaves the others waiting in a collective: the driver reports the
    # failed rank's error at once and stops them all; the timeout only bounds a lost rank.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=rank,
                            world_size=size, timeout=timeout)


def guarded_train_step(policy, batch: dict, old_logprobs: list[torch.Tensor] | None = None) -> dict:
    """policy.train_step, undone when any of its stats (loss, KL, gradient norm) is NaN or inf:
    a NaN reaches the parameters through the optimizer before it can be seen in them, so the
    state is snapshotted first (a copy of the trainable params and optimizer state: small for
    LoRA; for a full fine-tune it costs that much memory during the step)."""
    import copy
    import math

    snapshot = copy.deepcopy(policy.state_dict())
    stats = policy.train_step(batch, old_logprobs=old_logprobs)
    bad = sorted(k for k, v in stats.items() if not math.isfinite(v))
    if bad:
        policy.load_state_dict(snapshot)
        return {"stats": stats, "skipped": f"non-finite {', '.join(bad)}"}
    return {"stats": stats, "skipped": None}

