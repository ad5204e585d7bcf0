"""The rollout engine: a thin wrapper over vLLM's offline `LLM` that samples completions and
returns each sampled token's log-prob exactly as vLLM computed it.

`parity=True` selects the parity architecture registered by `rollout.plugin` (same weights,
parity kernels, parity attention); `parity=False` runs stock vLLM on the same checkpoint.
vLLM is imported lazily inside the class, so importing this module stays cheap.

By default vLLM keeps its multiprocessing (EngineCore and worker processes): the caller's
process stays free for torch.distributed. Scripts that build such an engine need an
`if __name__ == "__main__":` guard. `multiprocess=False` runs the EngineCore and its worker in
the caller's process (what a Ray actor that owns the engine wants: weight and adapter syncs then
hand tensors over by reference).
In-process, vLLM also: joins (or initialises) torch.distributed's default group in this process
(a world of one; `close` leaves the group alive), reseeds torch's global RNG at start-up, and
caches its environment variables (undone after start-up, see below). On the CPU, a parity
engine samples with parity.sampling (rollout/sampler.py, installed through
rollout/vllm_patches.py): each token a pure function of its request's key, its position and its
logits, never of an RNG; a stock engine (parity off) keeps vLLM's sampler and its global RNG.

Prefix caching is on for parity Llama / Qwen3 engines on the CPU (`prefix_caching`; a GPU
engine keeps it off until it is tested there): a cached prompt
block's keys and values are the bits the same tokens would get computed again (every kernel
gives a row the same bits in any batch, and attention walks the same 64-key blocks from
position 0), so a warm cache changes no log-prob. `prefix_hits` counts the prompt tokens
taken from the cache. kimi-mini keeps it off (KDA's recurrent state is not in the paged cache).

Weight sync. `set_adapter` / `clear_adapter` (parity models) and `update_weights` change the
running engine's model in place between `generate` calls, and empty the prefix cache (nothing
computed with the old weights is reused); `adapter_checksums` and `weight_checksums` hash what the
model holds, for the caller to compare with what it sent. They run on the worker through
`LLM.collective_rpc` with the methods of `ParityWorkerExtension`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from parity import kernels, model_spec, native, weights
from parity.dtypes import dtype_string, torch_dtype
from parity.lora import AdapterLayout, adapter_shapes
from parity.model_spec import KV_CACHE_DTYPE_KEY, KimiSpec, check_kv_cache_dtype, load_spec
from parity.sampling import Sampling, request_key
from parity.wire import index_for, unpack_tensors
from rollout.vllm_patches import (
    install_parity_sampler,
    keep_default_process_group,
    keep_set_num_threads,
    prepack_moe_on_update,
    thaw_envs_cache,
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_WORKER_EXTENSION = "rollout.engine.ParityWorkerExtension"


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    # float32 [len(token_ids)]: vLLM's log-prob of each sampled token under the distribution it
    # was sampled from (processed: temperature, top-k / top-p; the raw log-softmax without them)
    rollout_logprobs: torch.Tensor
    # Prompt tokens whose KV vLLM took from its prefix cache instead of computing them.
    cached_tokens: int = 0


@dataclass(frozen=True)
class Stop:
    """Where a completion ends besides EOS and max_tokens: at one of `token_ids` (the token is
    kept), or at the token that completes one of `strings` in the decoded text (kept too:
    include_stop_str_in_output; vLLM drops the ids and log-probs after it). The ids returned
    are still exactly the ids sampled: nothing is re-tokenized."""

    token_ids: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()


def parity_architecture(model_dir: str | Path) -> str:
    """The registered parity architecture for a checkpoint's HF architecture."""
    return model_spec.parity_architecture(model_spec.hf_architecture(model_dir))


@contextmanager
def _environ(values: dict[str, str], *, override: bool = False):
    """Set environment variables for the duration of the block: only those the user has not
    set, or (override) all of them, restoring the user's values afterwards."""
    chosen = {k: v for k, v in values.items() if override or k not in os.environ}
    saved = {k: os.environ.get(k) for k in chosen}
    os.environ.update(chosen)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


Tensors = dict[str, torch.Tensor]


def _unpack(payload: Tensors | bytes) -> Tensors:
    """Worker side of _pack: a dict arrives as is (in-process), bytes are safetensors."""
    if isinstance(payload, dict):
        return payload
    from safetensors.torch import load

    return load(bytes(payload))


class ParityWorkerExtension:
    """Methods vLLM mixes into its worker class (`worker_extension_cls`); `self` is the worker,
    its model `self.model_runner.get_model()`. Called by name through `collective_rpc`: a
    callable would have to be pickled to reach another process, which vLLM only allows with
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (pickle on its whole IPC channel)."""

    def _kimi_rl_parity_model(self):
        from rollout.kimi import ParityKimiLinearForCausalLM
        from rollout.llama import ParityLlamaForCausalLM

        model = self.model_runner.get_model()
        if not isinstance(model, ParityLlamaForCausalLM | ParityKimiLinearForCausalLM):
            raise ValueError(f"needs a parity model, this engine runs {type(model).__name__}")
        return model

    def kimi_rl_set_adapter(self, payload: Tensors | bytes, scaling: float) -> None:
        self._kimi_rl_parity_model().set_adapter(_unpack(payload), scaling)

    def kimi_rl_set_adapter_packed(self, flat, index, scaling: float) -> None:
        self._kimi_rl_parity_model().set_adapter_packed(flat, index, scaling)

    def kimi_rl_update_params_packed(self, flat, index) -> None:
        self._kimi_rl_parity_model().update_params_packed(flat, index)

    def kimi_rl_param_checksums(self) -> dict[str, str]:
        return self._kimi_rl_parity_model().param_checksums()

    def kimi_rl_clear_adapter(self) -> None:
        self._kimi_rl_parity_model().clear_adapter()

    def kimi_rl_adapter_checksums(self) -> dict[str, str]:
        return self._kimi_rl_parity_model().adapter_checksums()

    def kimi_rl_adapter_digest(self) -> str:
        return self._kimi_rl_parity_model().adapter_digest()

    def kimi_rl_param_digest(self, names: list[str]) -> str:
        return self._kimi_rl_parity_model().param_digest(names)

    def kimi_rl_update_weights(self, payload: Tensors | bytes) -> None:
        # vLLM's in-place reload: the model's load_weights through the parameters' (wrapped)
        # weight loaders, into the live storage; a stock MoE's experts prepacked again.
        prepack_moe_on_update()
        self.reload_weights(weights_iterator=iter(_unpack(payload).items()))

    def kimi_rl_weight_checksums(self) -> dict[str, str]:
        return self._kimi_rl_parity_model().weight_checksums()

    def kimi_rl_trace(self, on: bool) -> None:
        from rollout.kimi_trace import RoutingTrace

        old = getattr(self, "_kimi_rl_tracer", None)
        if old is not None:
            old.remove()
        self._kimi_rl_tracer = RoutingTrace(self._kimi_rl_parity_model()) if on else None

    def kimi_rl_take_trace(self) -> list[dict]:
        tracer = getattr(self, "_kimi_rl_tracer", None)
        return tracer.take() if tracer is not None else []

    def kimi_rl_install_sampler(self) -> bool:
        return install_parity_sampler(self.model_runner)

    def kimi_rl_kernel_info(self) -> dict:
        from parity.kernels import kernel_info

        return {**kernel_info(), "sampler": type(self.model_runner.sampler).__name__}

    def kimi_rl_reseed(self, seed: int) -> None:
        # Requests without a seed of their own sample from this process's default generator.
        torch.manual_seed(seed)


def _checks(spec):
    """The module whose adapter_pairs validate this spec's model."""
    if isinstance(spec, KimiSpec):
        from rollout import kimi

        return kimi
    from rollout import llama

    return llama


def check_stock_engine(spec) -> None:
    """Refuse a model that stock vLLM (parity off) cannot run on this platform: ValueError
    saying why. Called before any engine starts; vLLM would otherwise die in its EngineCore."""
    if isinstance(spec, KimiSpec):
        raise ValueError("kimi-mini has no stock vLLM model: its KDA / MLA / MoE layers exist "
                         "only as parity implementations")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if spec.head_dim not in sizes:
            raise ValueError(f"head_dim {spec.head_dim}: stock vLLM's CPU attention supports "
                             f"head sizes {', '.join(map(str, sizes))} only")


def check_adapter(spec, dtype: str, tensors: dict[str, torch.Tensor], scaling: float) -> None:
    """Refuse an adapter that does not fit the model (peft names, layers, rank-r shapes):
    ValueError naming the first bad tensor. Needs no engine: call it before starting one."""
    _checks(spec).adapter_pairs(spec, torch_dtype(dtype), tensors, scaling)


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
        multiprocess: bool = True,
        tensor_parallel_size: int = 1,
        prefix_caching: bool | None = None,
        adapter_layout: AdapterLayout | None = None,
        isa: str | None = None,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float | None = None,
    ) -> None:
        torch_dtype(dtype)  # ValueError for an unknown name, before anything starts
        # The code path of the compiled kernels in the engine's processes, if not this one's
        # (KIMI_RL_ISA): they read it when they start, so it needs processes of their own.
        isa_env = native.isa_environment(isa) if isa is not None else {}
        if isa is not None and not multiprocess:
            raise ValueError("isa needs multiprocess=True (the engine's own processes pick the path)")
        if adapter_layout is not None and not parity:
            raise ValueError("adapter_layout needs a parity engine (parity=True)")
        self.adapter_layout = adapter_layout
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.parity = parity
        self.multiprocess = multiprocess
        self.spec = load_spec(self.model_dir) if parity else None
        check_kv_cache_dtype(kv_cache_dtype, model_spec.hf_architecture(model_dir) if parity else None)
        self.kv_cache_dtype = kv_cache_dtype
        if adapter_layout is not None:
            if isinstance(self.spec, KimiSpec):
                raise ValueError("adapter_layout: the Kimi parity model cannot reserve an adapter yet")
            self._reserved_index = index_for(adapter_shapes(self.spec, adapter_layout), torch_dtype(dtype))
        if prefix_caching is None:  # on where it is tested bitwise (see the module docstring)
            from vllm.platforms import current_platform

            prefix_caching = parity and not isinstance(self.spec, KimiSpec) and current_platform.is_cpu()
        self.prefix_caching = prefix_caching
        self.prefix_hits = 0
        # Small KV cache and both cores, unless the user chose otherwise.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        self.tensor_parallel_size = tensor_parallel_size
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if tensor_parallel_size > 1:
            # TP workers are separate processes: in-process (UniProcExecutor) runs one worker.
            if not multiprocess:
                raise ValueError("tensor_parallel_size > 1 needs multiprocess=True")
            if self.spec is not None:
                from parity.tp import check_tp

                check_tp(self.spec, tensor_parallel_size)
            # vLLM's "auto" binding takes one NUMA node per rank; on one node, give each worker
            # its own share of the allowed cores ("0|1" on 2 cores), unless the user chose.
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) >= tensor_parallel_size:
                per = len(cpus) // tensor_parallel_size
                groups = [cpus[r * per : (r + 1) * per] for r in range(tensor_parallel_size)]
                os.environ.setdefault(
                    "VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups)
                )

        from vllm import LLM

        from rollout.plugin import register

        register()  # the entry point does this too; harmless, and works without an install
        kwargs = {}
        if parity:
            kwargs["hf_overrides"] = {"architectures": [parity_architecture(self.model_dir)]}
            # The parity sampler counts a request's sampled tokens when it samples the next one:
            # synchronous scheduling (vLLM's CPU platform has nothing else; CUDA defaults to async).
            kwargs["async_scheduling"] = False
            if adapter_layout is not None:  # the model reserves it before any graph is captured
                kwargs["hf_overrides"]["kimi_rl_adapter"] = adapter_layout.as_dict()
            if kv_cache_dtype != "auto":  # the model builds its cache entries in that format
                kwargs["hf_overrides"][KV_CACHE_DTYPE_KEY] = kv_cache_dtype
            if isinstance(self.spec, KimiSpec):
                # vLLM sizes a hybrid's cache pages from its config: restate there the width
                # of this model's cache slot (parity.model_spec.mla_slot_width), as kimi-linear's
                # MLA latent of kv_lora_rank + qk_rope_head_dim values, or as an old kimi-mini
                # config's (parity/hf_config.py) one KV head of head_dim. The model reads its
                # checkpoint's config.json.
                slot = dataclasses.replace(self.spec, kv_cache_dtype=kv_cache_dtype).mla_slot_width(
                    torch_dtype(dtype).itemsize)
                if model_spec.hf_architecture(self.model_dir) == model_spec.KIMI_MINI_ARCHITECTURE:
                    kwargs["hf_overrides"]["head_dim"] = slot // 2
                else:
                    kwargs["hf_overrides"]["kv_lora_rank"] = slot - self.spec.qk_rope_head_dim
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        if gpu_memory_utilization is not None:  # None: vLLM's default
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if tensor_parallel_size > 1:
            # Worker processes of its own, also inside a Ray actor (where vLLM would otherwise
            # pick its Ray executor, which vllm-cpu does not support).
            kwargs["distributed_executor_backend"] = "mp"
        has_tokenizer = any((Path(self.model_dir) / f).exists() for f in _TOKENIZER_FILES)
        # Eager means eager for the engine's children too: without this, vLLM still
        # torch.compiles two sampler helpers (ranks of the returned log-probs, random sampling),
        # ~25 s on the first generate with a cold compile cache. Neither changes a log-prob.
        # Set only while the EngineCore is spawned (it inherits the environment), so this
        # process's torch is untouched; in-process it reaches the decorators of the vLLM
        # modules imported during construction (torch.compile reads it when it decorates).
        import torch._dynamo  # noqa: F401  (reads TORCHDYNAMO_DISABLE at import: do it before)

        # vLLM captures CUDA graphs once, at start, of a model without an adapter.
        self._captures_cuda_graphs = not enforce_eager and torch.cuda.is_available()

        child_env = {"TORCHDYNAMO_DISABLE": "1"} if enforce_eager else {}
        mode_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", **isa_env}
        # In-process, vLLM's CPU worker replaces torch.set_num_threads with a no-op for the
        # whole process: keep the caller's (rollout/vllm_patches.py).
        with _environ(child_env), _environ(mode_env, override=True), keep_set_num_threads():
            self.llm = LLM(
                model=self.model_dir,
                dtype=dtype_string(dtype),
                seed=seed,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                enforce_eager=enforce_eager,
                enable_chunked_prefill=True,
                enable_prefix_caching=prefix_caching,
                skip_tokenizer_init=not has_tokenizer,
                worker_extension_cls=_WORKER_EXTENSION,
                tensor_parallel_size=tensor_parallel_size,
                # The log-prob of the distribution a token was sampled from (after temperature,
                # top-k, top-p): what the trainer's parity.sampling computes. Without those, it
                # is the raw log-softmax bit for bit (x / 1.0 is x; no filter runs).
                logprobs_mode="processed_logprobs",
                **kwargs,
            )
        # A parity engine's workers sample with parity.sampling from here on (rollout/
        # vllm_patches.py, patch 5). Parity off, or KIMI_RL_INVARIANT_KERNELS=0, is stock vLLM:
        # its own sampler, drawing from the worker's global generator.
        self.parity_sampler = parity and kernels.INVARIANT and bool(self._rpc("kimi_rl_install_sampler"))
        self.seed = seed
        if not multiprocess:
            # The in-process EngineCore froze vLLM's view of the environment,
            # VLLM_ENABLE_V1_MULTIPROCESSING=0 included (rollout/vllm_patches.py).
            thaw_envs_cache()

    # --- sampling -------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        sampling: Sampling | None = None,
        *,
        ignore_eos: bool = False,
        keys: list[int] | None = None,
        stop: Stop | None = None,
    ) -> list[Completion]:
        """Sample one completion per prompt from the distribution `sampling` describes
        (default: temperature 1, no top-k / top-p); all prompts go to vLLM in one call.

        keys[i]: prompt i's request key (parity.sampling.request_key), default that of (the
        engine's seed, step 0, prompt i, sample 0). The parity sampler draws token t of a
        completion from (its key, t, its logits) alone, so a prompt samples the same tokens in
        any batch, chunking or schedule. (A per-request SamplingParams.seed is not used: it
        breaks vllm-cpu 0.32 under chunked prefill, "CPU Generator does not use offset".)
        `stop`: where a completion may end early (stop strings need the model's tokenizer)."""
        from vllm import SamplingParams, TokensPrompt

        from rollout.sampler import KEY

        sampling = sampling or Sampling()
        stop = stop or Stop()
        if keys is None:
            keys = [request_key(self.seed, 0, i, 0) for i in range(len(prompts))]
        if len(keys) != len(prompts):
            raise ValueError(f"generate: {len(keys)} keys for {len(prompts)} prompts")
        base = dict(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=max_tokens,
            logprobs=0,
            ignore_eos=ignore_eos,
            # Stop strings are matched on vLLM's incremental detokenization: only then is it on.
            detokenize=bool(stop.strings),
            stop=list(stop.strings) or None,
            stop_token_ids=list(stop.token_ids) or None,
            include_stop_str_in_output=True,
        )
        params = [SamplingParams(**base, extra_args={KEY: key}) for key in keys]
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
                    cached_tokens=out.num_cached_tokens or 0,
                )
            )
        self.prefix_hits += sum(c.cached_tokens for c in completions)
        return completions

    def reseed(self, seed: int) -> None:
        """The seed of `generate`'s default keys from now on. vLLM's own sampler (a CUDA or
        a stock engine) draws from the worker's global torch RNG instead: that is restarted too."""
        self.seed = int(seed)
        self._rpc("kimi_rl_reseed", int(seed))

    def kernel_info(self) -> dict:
        """The first worker's kernels (parity.kernels.kernel_info) and sampler class."""
        return self._rpc("kimi_rl_kernel_info")

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

    # --- weight sync ----------------------------------------------------------------------

    def _rpc(self, method: str, *args):
        # Every worker runs it (tensor parallelism: each applies its own shard of the full
        # tensors sent; checksums are of the gathered full tensors, the same on every worker):
        # the first worker's result.
        return self.llm.collective_rpc(method, args=args)[0]

    def _pack(self, tensors: Tensors) -> Tensors | bytes:
        """In-process the worker gets the dict itself (it copies what it keeps); across
        processes vLLM's IPC does not carry tensors in rpc arguments, safetensors bytes do."""
        if not self.multiprocess:
            return tensors
        from safetensors.torch import save

        return save({k: v.detach().contiguous() for k, v in tensors.items()})

    def _reset_prefix_cache(self) -> None:
        # After a weight or adapter change: cached KV was computed with the old model.
        if self.prefix_caching and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache after a weight sync")

    def _require_parity(self, what: str) -> None:
        if not self.parity:
            raise ValueError(
                f"{what} needs a parity engine (parity=True); stock vLLM LoRA is not supported"
            )

    def _require_capturable_adapter(self, what: str, scaling: float) -> None:
        # A graph captured at start replays the buffers and the scaling it saw then: an adapter
        # must be reserved before the capture (adapter_layout), and keep that scaling.
        if self._captures_cuda_graphs and self.adapter_layout is None:
            raise ValueError(
                f"{what}: a LoRA adapter on a CUDA-graph engine must be reserved at start"
                " (RolloutEngine(adapter_layout=...); rollout.cuda_graphs with lora), or run eager"
            )
        if self.adapter_layout is not None and float(scaling) != self.adapter_layout.scaling:
            raise ValueError(
                f"{what}: scaling {scaling}, but this engine reserved its adapter with"
                f" scaling {self.adapter_layout.scaling} (fixed for the run)"
            )

    def _reserved_form_error(self, got: int) -> str:
        return (f"this engine reserved a LoRA adapter of {len(self._reserved_index)} tensors"
                f" ({self.adapter_layout}) and takes only that form; got {got} tensors in another layout")

    def set_adapter(self, tensors: Tensors, scaling: float) -> None:
        """Compute with a LoRA adapter from now on, replacing any previous one: `tensors` by
        peft name (parity.lora.peft_key) in the engine dtype, e.g.
        trainer.megatron.lora.rollout_tensors(model); `scaling` = alpha / rank."""
        self._require_parity("set_adapter")
        self._require_capturable_adapter("set_adapter", scaling)
        # The worker checks again; checking here first raises ValueError in this process
        # (across processes vLLM turns a worker's exception into a bare Exception) and sends
        # nothing that would be refused.
        check_adapter(self.spec, self.dtype, tensors, scaling)
        if self.adapter_layout is not None:  # the dtype is checked above
            reserved = {name: tuple(shape) for name, _, shape, *_ in self._reserved_index}
            if {n: tuple(t.shape) for n, t in tensors.items()} != reserved:
                raise ValueError(self._reserved_form_error(len(tensors)))
        self._rpc("kimi_rl_set_adapter", self._pack(tensors), float(scaling))
        self._reset_prefix_cache()

    def set_adapter_packed(self, flat, index, scaling: float) -> None:
        """set_adapter from the sync wire format (parity.wire.pack_tensors): one flat buffer
        and its index. Checked like set_adapter the first time a layout arrives; after that a
        sync is one copy into the buffer the model computes from."""
        self._require_parity("set_adapter_packed")
        if not math.isfinite(scaling):
            raise ValueError(f"scaling must be finite, got {scaling}")
        self._require_capturable_adapter("set_adapter_packed", scaling)
        index = tuple(index)
        if self.adapter_layout is not None:
            if tuple((n, d, tuple(shape), o, b) for n, d, shape, o, b in index) != self._reserved_index:
                raise ValueError(self._reserved_form_error(len(index)))
        if index != getattr(self, "_checked_index", None):
            # As in set_adapter: refuse a bad adapter here, before the worker sees it (across
            # processes vLLM turns a worker's exception into a bare one). Once per layout.
            _checks(self.spec).adapter_pairs(self.spec, torch_dtype(self.dtype), unpack_tensors(flat, index), scaling)
            self._checked_index = index
        if self.multiprocess:  # vLLM's IPC carries bytes, not arrays
            flat = bytes(memoryview(flat)) if not isinstance(flat, bytes) else flat
        self._rpc("kimi_rl_set_adapter_packed", flat, index, float(scaling))
        self._reset_prefix_cache()

    def clear_adapter(self) -> None:
        """Back to the base model, bitwise."""
        self._require_parity("clear_adapter")
        if self.adapter_layout is not None:
            raise ValueError("clear_adapter: this engine reserved its adapter at start (adapter_layout);"
                             " it keeps one for the run")
        self._rpc("kimi_rl_clear_adapter")
        self._reset_prefix_cache()

    def adapter_checksums(self) -> dict[str, str]:
        """{peft name: tensor_checksum (XXH3-128 hex) of the tensor's bytes as the rollout model holds it}."""
        self._require_parity("adapter_checksums")
        return self._rpc("kimi_rl_adapter_checksums")

    def adapter_digest(self) -> str:
        """parity.wire.digest of the adapter the rollout model holds: equal to the digest of the
        packed buffer that set it (set_adapter_packed), in one pass over its bytes."""
        self._require_parity("adapter_digest")
        return self._rpc("kimi_rl_adapter_digest")

    def update_weights(self, named: Tensors) -> None:
        """Copy full weights, by HF checkpoint name, into the running model (vLLM's in-place
        reload; values are cast to the engine dtype as on a checkpoint load). Weights not
        named keep their values (vLLM logs them as not loaded)."""
        if self.parity:
            weights.check_hf_weights(self.spec, named)
        self._rpc("kimi_rl_update_weights", self._pack(named))
        self._reset_prefix_cache()

    def update_params_packed(self, flat, index) -> None:
        """Full-weight sync of a parity engine from the wire format (parity.wire), by the
        rollout model's parameter names in its fused layouts: a copy per parameter."""
        self._require_parity("update_params_packed")
        if self.multiprocess:  # vLLM's IPC carries bytes, not arrays
            flat = bytes(memoryview(flat)) if not isinstance(flat, bytes) else flat
        self._rpc("kimi_rl_update_params_packed", flat, tuple(index))
        self._reset_prefix_cache()

    def param_checksums(self) -> dict[str, str]:
        """{rollout parameter name: tensor_checksum hex}, the names update_params_packed takes."""
        self._require_parity("param_checksums")
        return self._rpc("kimi_rl_param_checksums")

    def param_digest(self, names: list[str]) -> str:
        """parity.wire.digest_tensors of the named parameters, in this order: equal to the
        digest of the update_params_packed buffer that wrote them."""
        self._require_parity("param_digest")
        return self._rpc("kimi_rl_param_digest", list(names))

    def weight_checksums(self) -> dict[str, str]:
        """{HF checkpoint name: tensor_checksum hex of the weight the rollout model holds}."""
        self._require_parity("weight_checksums")
        return self._rpc("kimi_rl_weight_checksums")

    def trace(self, on: bool) -> None:
        """kimi-mini parity engines: start (clearing) or stop recording each step's routing
        (MoE experts, indexer selections); see rollout.kimi."""
        self._require_parity("trace")
        self._rpc("kimi_rl_trace", bool(on))

    def take_trace(self) -> list[dict[str, torch.Tensor]]:
        """What was recorded since the last take, per request (rollout.kimi_trace.trace_by_request;
        requests in order of their first step). In-process engines (tensors in rpc results)."""
        from rollout.kimi_trace import trace_by_request

        self._require_parity("take_trace")
        return trace_by_request(self._rpc("kimi_rl_take_trace"))

    # --- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            with keep_default_process_group(enabled=not self.multiprocess):
                engine_core.shutdown()
        del llm

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
