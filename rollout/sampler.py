"""The rollout's sampler: vLLM's V1 `Sampler` with its sampling step replaced by parity.sampling.

vLLM keeps the steps before sampling (logits to fp32, allowed / bad words, penalties and the
logits processors, all no-ops for kimi-rl's requests) and the gathering of the returned
log-probs after it; `sample` and `compute_logprobs` are ours:

- a request with temperature >= 1e-5 gets its processed log-probs from
  parity.sampling.processed_logprobs_rows (compiled: temperature, top-k / top-p with defined
  orders, log-softmax) and its token from parity.sampling.sample_tokens, keyed by the request's
  `SamplingParams.extra_args["kimi_rl_key"]` (parity.sampling.request_key; RolloutEngine sets
  it) and the token's index in its completion;
- a greedy request (below 1e-5, vLLM's rule) takes the first largest logit, its log-probs those
  of the raw logits at temperature 1 (vLLM's rule too);
- `compute_logprobs` (raw log-probs, prompt log-probs) is the compiled log-softmax.

Installed on a model runner by rollout.vllm_patches.install_parity_sampler, on the CPU and on
CUDA: a CUDA engine's logits rows are copied to the host for these steps (the compiled kernels
are CPU code), so the GPU samples with the bits of the CPU. Positions need synchronous
scheduling (RolloutEngine turns vLLM's asynchronous scheduling off for a parity engine).
"""

from __future__ import annotations

import torch
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import _SAMPLING_EPS, Sampler

from parity import kernels
from parity.sampling import processed_logprobs_rows, sample_tokens

# The SamplingParams.extra_args entry that carries a request's 64-bit key (RolloutEngine sets it).
KEY = "kimi_rl_key"


class ParitySampler(Sampler):
    def __init__(self, runner, logprobs_mode: str) -> None:
        if logprobs_mode == "processed_logits":
            raise ValueError("the parity sampler returns log-probs: logprobs_mode processed_logits is not supported")
        super().__init__(logprobs_mode=logprobs_mode)
        # The model runner: its input batch gives each logits row's request, and the request's
        # state its key and how many tokens it has sampled so far.
        self.runner = runner

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return kernels.log_softmax(logits)

    def _keys_and_positions(self, rows: int, random: list[int]) -> tuple[list[int], list[int]]:
        keys, positions = [], []
        req_ids = self.runner.input_batch.req_ids
        for i in random:
            state = self.runner.requests[req_ids[i]]
            extra = state.sampling_params.extra_args or {}
            if KEY not in extra:
                raise ValueError(f"request {req_ids[i]}: a sampled request needs "
                                 f"SamplingParams.extra_args[{KEY!r}] (parity.sampling.request_key)")
            keys.append(int(extra[KEY]))
            # Synchronous scheduling (vLLM's CPU platform forces it; RolloutEngine asks for it
            # on CUDA): the tokens sampled so far.
            positions.append(len(state.output_token_ids))
        return keys, positions

    def sample(
        self, logits: torch.Tensor, sampling_metadata: SamplingMetadata, logprobs_mode_override=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mode = logprobs_mode_override or self.logprobs_mode
        rows = logits.shape[0]
        # Argmax-invariant logits processors (min-p) act before the top-k / top-p cut, as in vLLM.
        for processor in sampling_metadata.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        # The compiled sampler runs on the host: a CUDA engine's logits come over and the tokens
        # (and log-probs) go back.
        device, logits = logits.device, logits.cpu()
        temperature = sampling_metadata.temperature
        if sampling_metadata.all_greedy or temperature is None:
            temperature = torch.zeros(rows, dtype=torch.float32)
        temperature = temperature.cpu()
        greedy = temperature < _SAMPLING_EPS
        top_k, top_p = (None if t is None else t.cpu() for t in (sampling_metadata.top_k, sampling_metadata.top_p))
        logprobs = processed_logprobs_rows(logits, torch.where(greedy, 1.0, temperature.float()), top_k, top_p)
        tokens = logits.argmax(dim=-1)  # greedy rows: an exact comparison, first index on ties
        random = (~greedy).nonzero().squeeze(1).tolist()
        if random:
            keys, positions = self._keys_and_positions(rows, random)
            tokens[random] = sample_tokens(logprobs[random], keys, positions)
        return tokens.to(device), logprobs.to(device) if mode == "processed_logprobs" else None
