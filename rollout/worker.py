"""The rollout worker: one vLLM engine inside a Ray actor.

The engine runs in the actor's own process (no EngineCore child), so an adapter or a weight
bucket that arrives through Ray's object store is copied straight into the model's tensors —
no disk, no second serialisation. Sampling is reseeded for every call from (seed, step,
worker), so a resumed run samples exactly what the uninterrupted run sampled.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from parity.lora import AdapterLayout
from parity.sampling import Sampling
from parity.wire import Index, unpack_tensors
from rollout.engine import RolloutEngine, Stop


def _set_threads() -> None:
    # Ray sets OMP_NUM_THREADS to the actor's logical CPUs (1); the loop is synchronous, so the
    # engine may use every core while it samples. Thread count does not change a log-prob.
    n = os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


class RolloutWorker:
    def __init__(
        self, index: int, model_dir: str, *, dtype: str, parity: bool, seed: int,
        max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int | None,
        tensor_parallel_size: int = 1, enforce_eager: bool = True, adapter_layout: AdapterLayout | None = None,
        kv_cache_dtype: str = "auto", gpu_memory_utilization: float | None = None,
    ) -> None:
        _set_threads()
        self.index = index
        # TP workers are processes of their own, so TP > 1 keeps vLLM's EngineCore process
        # (sampling is the same either way: each token is a function of its request's key).
        self.engine = RolloutEngine(
            model_dir, dtype=dtype, parity=parity, seed=seed, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            multiprocess=tensor_parallel_size > 1, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, adapter_layout=adapter_layout, kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization,
        )

    def generate(
        self, prompts: list[list[int]], max_tokens: int, sampling: Sampling, seed: int,
        keys: list[int] | None = None, stop: Stop | None = None,
    ) -> list[dict]:
        """Sample one completion per prompt; returns token ids, rollout log-probs and the prompt
        tokens taken from the prefix cache. `seed` reseeds the engine (stock vLLM samples from
        it); `keys` are the parity sampler's request keys, `stop` where a completion may end
        early (RolloutEngine.generate)."""
        self.engine.reseed(seed)
        done = self.engine.generate(prompts, max_tokens=max_tokens, sampling=sampling, keys=keys, stop=stop)
        return [
            {"prompt_ids": c.prompt_ids, "token_ids": c.token_ids, "rollout_logprobs": c.rollout_logprobs,
             "cached_tokens": c.cached_tokens}
            for c in done
        ]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        return self.engine.prompt_logprobs(sequences)

    def sync_adapter(self, packed: tuple[np.ndarray, Index], scaling: float, digest: bool = True) -> str | None:
        """Hold this adapter (parity.wire form) from now on; returns the parity.wire.digest of
        what the model now holds, one pass over its buffer (None with digest=False)."""
        self.engine.set_adapter_packed(*packed, scaling)
        return self.engine.adapter_digest() if digest else None

    def sync_weights(self, packed: tuple[np.ndarray, Index], digest: bool = True) -> str | None:
        """Full-weight sync of one bucket (parity.wire form); returns the digest of the
        parameters it now holds under the bucket's names, in its order (None with digest=False,
        and from a stock engine). A parity engine takes its own fused parameters (a copy each);
        a stock engine takes HF names through vLLM's reload."""
        if not self.engine.parity:
            self.engine.update_weights(unpack_tensors(*packed))
            return None  # stock vLLM repacks weights for its kernels: nothing to verify
        self.engine.update_params_packed(*packed)
        return self.engine.param_digest([name for name, *_ in packed[1]]) if digest else None

    def adapter_checksums(self) -> dict[str, str]:
        """tensor_checksum of each held adapter tensor, by peft name (names a digest mismatch)."""
        return self.engine.adapter_checksums()

    def param_checksums(self, names: list[str]) -> dict[str, str]:
        """tensor_checksum of the named parameters it holds ({} from a stock engine)."""
        if not self.engine.parity:
            return {}
        held = self.engine.param_checksums()
        return {name: held[name] for name in names if name in held}

    def close(self) -> None:
        self.engine.close()
