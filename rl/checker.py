"""`kimi-rl parity check`: sample in vLLM, re-score the same tokens in Megatron (or, with
`--trainer deepspeed`, in the deepspeed backend's HF parity model under ZeRO), compare. The
trainer side is reached through trainer.backend only (`rescore`).

Flow: validate every input before any engine starts; sample completions for each batch size
with one vLLM engine (engine-seeded; temperature / top-p / top-k from the flags, default 1 / off /
off); close it; score exactly those tokens with the trainer backend (in different batches than
vLLM used) under the same sampling transform (parity.sampling: vLLM's processed log-probs);
compare bit for bit; print a table; write report.json + HTML + PNGs; exit 1 on any mismatch
when parity is on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from parity import native
from parity.compare import compare_logprobs
from parity.dtypes import torch_dtype
from parity.kernels import kernel_info
from parity.lora import AdapterLayout
from parity.model_spec import KimiSpec, check_kv_cache_dtype, hf_architecture, load_spec
from parity.sampling import Sampling, request_key
from rl.errors import UserError
from trainer.backend import Adapter

BUILTIN_PROMPTS = [
    "The quick brown fox",
    "Question: what is 12 + 7? Answer:",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The capital of France is",
    "List three prime numbers:",
    "In reinforcement learning, the policy",
    "A",
    "Translate to French: good morning",
    "The sum of the first ten positive integers is",
    "Rain fell on the old stone bridge while",
    "Step 1: preheat the oven. Step 2:",
]


@dataclass
class CheckArgs:
    model: Path
    dtype: str
    prompts: Path | None
    num_prompts: int
    max_tokens: int
    batch_sizes: list[int]
    parity: bool
    seed: int
    report: Path | None
    max_num_batched_tokens: int | None
    rollout_tp: int = 1  # vLLM's tensor-parallel size
    trainer_tp: int = 1  # Megatron's
    adapter: Path | None = None  # a peft LoRA adapter directory, applied on both sides
    sampling: Sampling = Sampling()  # what vLLM samples from; both sides score that distribution
    cuda_graphs: bool = False  # vLLM's default mode (torch.compile + CUDA graphs) instead of eager
    trainer: str = "megatron"  # the trainer backend that re-scores: megatron | deepspeed
    zero_stage: int = 2  # deepspeed's ZeRO stage
    rollout_isa: str | None = None  # the rollout's compiled-kernel path, if not KIMI_RL_ISA's
    env: str | None = None  # multi-turn trajectories of this environment (rl.env_check)
    max_turns: int = 3
    env_kwargs: dict = dataclasses.field(default_factory=dict)  # passed to the environment class
    prefix_caching: bool | None = None  # the --env engine's prefix cache; None: the engine's default
    kv_cache_dtype: str = "auto"  # "fp8": Kimi's MLA cache entries in e4m3, on both sides


def load_adapter(path: Path) -> Adapter:
    """A peft adapter directory (adapter_model.safetensors + adapter_config.json, as the
    trainer's checkpoints and peft write them): (tensors by peft name, rank, alpha, targets)."""
    from safetensors.torch import load_file

    config_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (config_path, weights_path):
        if not f.is_file():
            raise UserError(f"--adapter: {path} has no {f.name} (not a peft LoRA adapter directory)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{config_path}:{e.lineno}: invalid JSON ({e.msg})") from None
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in config:
            raise UserError(f"{config_path}: no {key!r} entry")
    tensors = {k: v.float() for k, v in load_file(str(weights_path)).items()}
    return tensors, int(config["r"]), float(config["lora_alpha"]), sorted(config["target_modules"])


def add_parity_commands(subparsers) -> None:
    parity = subparsers.add_parser("parity", help="log-prob parity between vLLM and Megatron")
    sub = parity.add_subparsers(dest="parity_command", required=True, parser_class=type(parity))
    check = sub.add_parser("check", help="sample in vLLM, re-score in Megatron, compare bitwise")
    check.add_argument("--model", required=True, help="HF checkpoint directory")
    check.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    check.add_argument("--prompts", help="JSONL file: one {\"prompt\": str} or {\"prompt_ids\": [int]} per line")
    check.add_argument("--num-prompts", type=int, default=8)
    check.add_argument("--max-tokens", type=int, default=32)
    check.add_argument("--batch-sizes", default="1,8,32", help="comma-separated, e.g. 1,8,32")
    check.add_argument("--parity", choices=["on", "off"], default="on")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--report", help="directory for report.json, index.html and plots")
    check.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="vLLM scheduler token budget per step; small values force chunked prefill",
    )
    check.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="TP degree of both sides: vLLM workers and Megatron ranks (gloo), default 1",
    )
    check.add_argument("--rollout-tp", type=int, default=None,
                       help="vLLM's TP degree, if not --tensor-parallel-size's")
    check.add_argument("--trainer-tp", type=int, default=None,
                       help="Megatron's TP degree, if not --tensor-parallel-size's")
    check.add_argument("--temperature", type=float, default=1.0,
                       help="sampling temperature (>= 1e-5), default 1")
    check.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, (0, 1]; 1 = off")
    check.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0 = off")
    check.add_argument(
        "--adapter", help="peft LoRA adapter directory (e.g. RUN_DIR/checkpoints/step_N/adapter):"
        " both sides compute with it",
    )
    check.add_argument(
        "--rollout-isa", choices=["avx512_bf16", "avx512", "avx2", "scalar"], default=None,
        help="run the rollout's compiled kernels on this code path, the trainer's on KIMI_RL_ISA's"
        " (or the CPU's best): the bits must not change",
    )
    check.add_argument(
        "--cuda-graphs", choices=["on", "off"], default="off",
        help="on: vLLM's default mode (torch.compile and CUDA graphs where the model and backend"
        " allow them; GPU only); off: eager (default)",
    )
    check.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
        help="fp8: the Kimi architectures' MLA cache entries in e4m3 with a per-token scale, the"
        " trainer rounding them the same way; auto: the model dtype (default)",
    )
    check.add_argument("--trainer", choices=["megatron", "deepspeed"], default="megatron",
                       help="trainer backend that re-scores: Megatron, or the HF model under DeepSpeed")
    check.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=2,
                       help="ZeRO stage of --trainer deepspeed, default 2")
    check.add_argument("--env", help="multi-turn trajectories of an environment (probe, tools or "
                       "module:attr; rl.env): every model token of every turn is compared")
    check.add_argument("--max-turns", type=int, default=3, help="model turns per trajectory with --env")
    check.add_argument("--env-kwargs", default="{}", help='JSON object for the environment class, e.g. \'{"example": true}\'')
    check.set_defaults(func=run_check_command)


def _parse_batch_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        try:
            size = int(part)
        except ValueError:
            raise UserError(f"--batch-sizes: {part.strip()!r} is not an integer") from None
        if size < 1:
            raise UserError(f"--batch-sizes: batch size must be >= 1, got {size}")
        sizes.append(size)
    return sizes


def load_prompt_file(path: Path) -> list[dict]:
    """Each non-blank line: {"prompt": str} or {"prompt_ids": [int, ...]}."""
    if not path.is_file():
        raise UserError(f"--prompts: {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object with 'prompt' or 'prompt_ids'")
        if "prompt_ids" in row:
            ids = row["prompt_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
                raise UserError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        elif "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise UserError(f"{where}: 'prompt' must be a non-empty string")
        else:
            raise UserError(f"{where}: expected a 'prompt' or 'prompt_ids' field")
        rows.append(row)
    if not rows:
        raise UserError(f"--prompts: {path} has no prompts")
    return rows


def validate(ns: argparse.Namespace) -> CheckArgs:
    """Every flag checked, and its files read, before any engine starts."""
    from rl.models import validate_model_dir

    model = Path(ns.model)
    validate_model_dir(model)
    if ns.num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {ns.max_tokens}")
    if ns.max_num_batched_tokens is not None and ns.max_num_batched_tokens < 1:
        raise UserError("--max-num-batched-tokens must be >= 1")
    prompts = Path(ns.prompts) if ns.prompts else None
    if prompts is not None:
        load_prompt_file(prompts)  # fail on a bad line before any engine starts
    rollout_tp, trainer_tp = _tp_sizes(ns, model)
    adapter = Path(ns.adapter) if getattr(ns, "adapter", None) else None
    if adapter is not None:
        _check_adapter_fits(ns, model, adapter)
        if getattr(ns, "cuda_graphs", "off") == "on" and isinstance(load_spec(model), KimiSpec):
            raise UserError("--adapter with --cuda-graphs on: the Kimi parity model cannot reserve its"
                            " adapter before the capture yet (Llama and Qwen3 can); use --cuda-graphs off")
    if ns.parity == "off":
        _check_stock_engine(model)
    kv_cache_dtype = getattr(ns, "kv_cache_dtype", "auto")
    try:
        check_kv_cache_dtype(kv_cache_dtype, hf_architecture(model) if ns.parity == "on" else None)
    except ValueError as e:
        raise UserError(f"--kv-cache-dtype: {e}") from None
    rollout_isa = getattr(ns, "rollout_isa", None)
    if rollout_isa is not None and rollout_isa not in native.cpu_isas():
        raise UserError(f"--rollout-isa {rollout_isa}: this CPU runs {', '.join(native.cpu_isas())}")
    trainer = getattr(ns, "trainer", "megatron")
    if trainer == "deepspeed" and (ns.parity != "on" or trainer_tp > 1 or kv_cache_dtype != "auto"):
        raise UserError("--trainer deepspeed re-scores with the HF parity model: it needs "
                        "--parity on, --trainer-tp 1 and --kv-cache-dtype auto")
    env = getattr(ns, "env", None)
    env_kwargs = _check_env_flags(ns, env) if env is not None else {}
    report = Path(ns.report) if ns.report else None
    if report is not None and report.exists() and not report.is_dir():
        raise UserError(f"--report: {report} exists and is not a directory")
    return CheckArgs(
        model=model, dtype=ns.dtype, prompts=prompts, num_prompts=ns.num_prompts,
        max_tokens=ns.max_tokens, batch_sizes=_parse_batch_sizes(ns.batch_sizes),
        parity=ns.parity == "on", seed=ns.seed, report=report,
        max_num_batched_tokens=ns.max_num_batched_tokens, rollout_tp=rollout_tp, trainer_tp=trainer_tp,
        adapter=adapter, sampling=_sampling(ns), cuda_graphs=getattr(ns, "cuda_graphs", "off") == "on",
        trainer=trainer, zero_stage=getattr(ns, "zero_stage", 2),
        env=env, max_turns=getattr(ns, "max_turns", 3), env_kwargs=env_kwargs, rollout_isa=rollout_isa,
        kv_cache_dtype=kv_cache_dtype,
    )


def _tp_sizes(ns: argparse.Namespace, model: Path) -> tuple[int, int]:
    """(rollout TP, trainer TP): --rollout-tp / --trainer-tp, else --tensor-parallel-size;
    each one checked to split the model."""
    tp_size = getattr(ns, "tensor_parallel_size", 1)
    sizes = {
        "--rollout-tp": tp_size if getattr(ns, "rollout_tp", None) is None else ns.rollout_tp,
        "--trainer-tp": tp_size if getattr(ns, "trainer_tp", None) is None else ns.trainer_tp,
    }
    for flag, size in sizes.items():
        # The flag that set the size, so the message names what the user typed.
        named = flag if getattr(ns, flag[2:].replace("-", "_"), None) is not None else "--tensor-parallel-size"
        if size < 1:
            raise UserError(f"{named} must be >= 1, got {size}")
        if size > 1:
            from parity.model_spec import ModelSpec
            from parity.tp import check_tp

            try:
                check_tp(ModelSpec.from_dir(model), size)
            except ValueError as e:
                raise UserError(f"{named}: {e}") from None
    return sizes["--rollout-tp"], sizes["--trainer-tp"]


def _check_adapter_fits(ns: argparse.Namespace, model: Path, adapter: Path) -> None:
    """A bad adapter fails before any engine starts: its files, then its fit to the model."""
    if ns.parity != "on":
        raise UserError("--adapter needs --parity on (the parity models hold adapters in memory)")
    tensors, lora_rank, alpha, _ = load_adapter(adapter)
    from parity.model_spec import load_spec
    from rollout.engine import check_adapter

    try:
        check_adapter(load_spec(model), ns.dtype,
                      {k: v.to(torch_dtype(ns.dtype)) for k, v in tensors.items()}, alpha / lora_rank)
    except ValueError as e:
        raise UserError(f"--adapter {adapter}: does not fit {model}: {e}") from None


def _check_stock_engine(model: Path) -> None:
    from parity.model_spec import load_spec
    from rollout.engine import check_stock_engine

    try:
        check_stock_engine(load_spec(model))
    except ValueError as e:
        raise UserError(f"--parity off: stock vLLM cannot run {model}: {e}") from None


def _sampling(ns: argparse.Namespace) -> Sampling:
    try:
        return Sampling(getattr(ns, "temperature", 1.0), getattr(ns, "top_p", 1.0), getattr(ns, "top_k", 0))
    except ValueError as e:  # "top_p must be in (0, 1], got 2.0" -> "--top-p must be ..."
        flag, _, rest = str(e).partition(" ")
        raise UserError(f"--{flag.replace('_', '-')} {rest}") from None


def prompt_token_ids(args: CheckArgs) -> list[list[int]]:
    from transformers import AutoTokenizer

    rows = load_prompt_file(args.prompts) if args.prompts else [{"prompt": p} for p in BUILTIN_PROMPTS]
    tokenizer = None
    prompts = []
    for row in (rows[i % len(rows)] for i in range(args.num_prompts)):
        if "prompt_ids" in row:
            prompts.append(list(row["prompt_ids"]))
            continue
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(args.model))
        prompts.append(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] or [0])
    return prompts


def env_samples(args: CheckArgs) -> list:
    """The --env check's samples: text prompts (an environment builds its own prompt ids)."""
    from rl.data import Sample

    rows = load_prompt_file(args.prompts) if args.prompts else [{"prompt": p} for p in BUILTIN_PROMPTS]
    if any("prompt" not in r for r in rows):
        raise UserError("--env needs text prompts ({\"prompt\": str} rows): an environment builds "
                        "the prompt ids itself")
    return [Sample(rows[i % len(rows)]["prompt"]) for i in range(args.num_prompts)]


def _check_env_flags(ns: argparse.Namespace, env: str) -> dict:
    """--env, --max-turns, --env-kwargs checked; returns the environment's kwargs."""
    from rl.config import ConfigError, resolve_env
    from rl.env import BUILTIN_ENVS

    if env not in BUILTIN_ENVS and ":" not in env:
        raise UserError(f"--env: expected one of {', '.join(BUILTIN_ENVS)} or module:attr, got {env!r}")
    try:
        resolve_env(env)
    except ConfigError as e:
        raise UserError(f"--env: {str(e).removeprefix('env.name: ')}") from None
    if getattr(ns, "max_turns", 3) < 1:
        raise UserError(f"--max-turns must be >= 1, got {ns.max_turns}")
    if getattr(ns, "adapter", None):
        raise UserError("--env runs without --adapter for now")
    try:
        kwargs = json.loads(getattr(ns, "env_kwargs", "{}"))
    except json.JSONDecodeError as e:
        raise UserError(f"--env-kwargs: invalid JSON ({e.msg})") from None
    if not isinstance(kwargs, dict):
        raise UserError(f"--env-kwargs: expected a JSON object, got {kwargs!r}")
    if env in BUILTIN_ENVS:
        try:
            BUILTIN_ENVS[env].check_kwargs(kwargs)
        except ValueError as e:
            raise UserError(f"--env-kwargs: {e}") from None
    return kwargs


def batches_for(num_prompts: int, batch_size: int) -> list[list[int]]:
    """Full batches of `batch_size` prompt indices, cycling through the prompts, so each prompt
    lands at different batch positions for different batch sizes."""
    count = -(-num_prompts // batch_size)
    return [[(k * batch_size + j) % num_prompts for j in range(batch_size)] for k in range(count)]


@dataclass
class CheckResult:
    report: dict  # what report.json holds (see README for the fields)
    completions: list  # rollout.engine.Completion, in batch-size order
    train_logprobs: list[torch.Tensor]  # the trainer's scores of the same tokens, same order

    @property
    def diffs(self) -> list[torch.Tensor]:
        return [
            (c.rollout_logprobs - t).abs()
            for c, t in zip(self.completions, self.train_logprobs, strict=True)
        ]


def run_check(args: CheckArgs, console=None) -> CheckResult:
    """Sample in vLLM, close it, re-score the same tokens in the trainer backend, compare."""
    from rich.console import Console

    from parity.model_spec import load_spec

    console = console or Console(stderr=True)
    spec = load_spec(args.model)
    adapter = load_adapter(args.adapter) if args.adapter else None
    prompts = prompt_token_ids(args)
    context = _check_prompt_lengths(args, spec, prompts)

    t0 = time.perf_counter()
    samples, rollout = sample_in_vllm(args, spec, prompts, context, adapter, console)
    rollout_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    completions = [c for bs in args.batch_sizes for c in samples[bs]]
    train_logprobs = rescore_with_progress(args, completions, adapter, console)
    train_seconds = time.perf_counter() - t1

    seconds = {"rollout": round(rollout_seconds, 2), "train": round(train_seconds, 2)}
    return CheckResult(build_report(args, samples, completions, train_logprobs, seconds, rollout),
                       completions, train_logprobs)


def _check_prompt_lengths(args: CheckArgs, spec, prompts: list[list[int]]) -> int:
    """The longest prompt + --max-tokens, checked against the model's context and vocabulary."""
    too_long = max(len(p) for p in prompts) + args.max_tokens
    if too_long > spec.max_position_embeddings:
        raise UserError(
            f"prompt + --max-tokens is {too_long} tokens, above the model's "
            f"max_position_embeddings {spec.max_position_embeddings}"
        )
    for p in prompts:
        if max(p) >= spec.vocab_size:
            raise UserError(f"prompt token id {max(p)} is outside the vocabulary ({spec.vocab_size})")
    return too_long


def _reserved_layout(args: CheckArgs, adapter: Adapter | None) -> AdapterLayout | None:
    """With CUDA graphs, the engine holds the adapter's buffers from before the capture."""
    if adapter is None or not args.cuda_graphs:
        return None
    _, lora_rank, alpha, targets = adapter
    return AdapterLayout(lora_rank, tuple(targets), alpha / lora_rank)


def sample_in_vllm(
    args: CheckArgs, spec, prompts: list[list[int]], context: int, adapter, console
) -> tuple[dict[int, list], dict]:
    """({batch size: completions}, {"kernels": the engine's kernel_info, "prefix_cache": on and
    its hits}): every prompt batch of every batch size sampled by one vLLM engine (closed on
    return). Prompt i samples under the key of (--seed, step 0, prompt i), whatever batch it is
    in: the same tokens at every batch size (the later batch sizes hit the prefix cache)."""
    from rich.progress import Progress

    from rl.env_check import engine_processes
    from rollout.engine import RolloutEngine

    samples: dict[int, list] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("starting vLLM", total=None)
        with RolloutEngine(
            str(args.model), dtype=args.dtype, parity=args.parity, seed=args.seed,
            max_model_len=min(spec.max_position_embeddings, context + 1),
            max_num_seqs=max(args.batch_sizes),
            max_num_batched_tokens=args.max_num_batched_tokens,
            tensor_parallel_size=args.rollout_tp,
            multiprocess=engine_processes(args.rollout_tp, args.rollout_isa),
            enforce_eager=not args.cuda_graphs,
            adapter_layout=_reserved_layout(args, adapter), isa=args.rollout_isa,
            kv_cache_dtype=args.kv_cache_dtype,
        ) as engine:
            if adapter is not None:
                tensors, lora_rank, alpha, _ = adapter
                # The trainer computes with its fp32 masters cast to the model dtype: send that.
                engine.set_adapter({k: v.to(torch_dtype(args.dtype)) for k, v in tensors.items()}, alpha / lora_rank)
            kernels = engine.kernel_info()
            plan = [(bs, idx) for bs in args.batch_sizes for idx in batches_for(len(prompts), bs)]
            progress.update(task, description="sampling in vLLM", total=len(plan), completed=0)
            for bs, idx in plan:
                samples.setdefault(bs, []).extend(
                    engine.generate([prompts[i] for i in idx], max_tokens=args.max_tokens,
                                    sampling=args.sampling, keys=[request_key(args.seed, 0, i, 0) for i in idx])
                )
                progress.advance(task)
    cache = {"on": engine.prefix_caching, "hit_tokens": engine.prefix_hits}
    return samples, {"kernels": kernels, "prefix_cache": cache}


def rescore(
    args: CheckArgs, sequences: list[list[int]], starts: list[int], adapter: Adapter | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """The trainer backend's (--trainer, at --trainer-tp; trainer.backend) log-probs of the
    tokens seq[start:] under the sampling transform vLLM sampled with. `adapter`: (peft
    tensors, rank, alpha, targets), attached on every rank."""
    from trainer.backend import ScoreSetup, get_backend

    setup = ScoreSetup(
        model_dir=args.model, dtype=args.dtype, parity=args.parity, seed=args.seed,
        sampling=args.sampling, adapter=adapter, tensor_parallel_size=args.trainer_tp,
        zero_stage=args.zero_stage, kv_cache_dtype=args.kv_cache_dtype,
    )
    return get_backend(args.trainer).score(setup, sequences, starts, progress)


def rescore_with_progress(args: CheckArgs, completions: list, adapter, console) -> list[torch.Tensor]:
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"re-scoring in {args.trainer}", total=len(completions))
        return rescore(args, [c.prompt_ids + c.token_ids for c in completions],
                       [len(c.prompt_ids) for c in completions], adapter,
                       lambda n: progress.advance(task, n))


def build_report(args: CheckArgs, samples: dict[int, list], completions: list,
                 train_logprobs: list[torch.Tensor], seconds: dict[str, float], rollout: dict) -> dict:
    """What report.json holds: the settings, each side's kernels (ISA code path, whether the
    invariant kernels are on: parity.kernels.kernel_info; the trainer's are this process's,
    whose environment its ranks inherit), the rollout's prefix-cache hits, the comparison over
    all tokens and per batch size."""
    per_bs, offset = {}, 0
    for bs in args.batch_sizes:
        n = len(samples[bs])
        stats = compare_logprobs(
            [c.rollout_logprobs for c in samples[bs]], train_logprobs[offset : offset + n]
        )
        per_bs[str(bs)] = stats.to_dict()
        offset += n
    total = compare_logprobs([c.rollout_logprobs for c in completions], train_logprobs)
    return {
        "model": str(args.model),
        "dtype": args.dtype,
        "parity": "on" if args.parity else "off",
        "cuda_graphs": "on" if args.cuda_graphs else "off",
        "seed": args.seed,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "batch_sizes": args.batch_sizes,
        "rollout_tp": args.rollout_tp,
        "trainer_tp": args.trainer_tp,
        "adapter": str(args.adapter) if args.adapter else None,
        "sampling": dataclasses.asdict(args.sampling),
        "trainer": args.trainer,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kernels": {"rollout": rollout["kernels"], "trainer": kernel_info()},
        "prefix_cache": rollout["prefix_cache"],
        **total.to_dict(),
        "passed": total.all_equal,
        "per_batch_size": per_bs,
        "seconds": seconds,
    }


def print_table(report: dict, console) -> None:
    from rich.table import Table

    title = f"parity {report['parity']} · {report['dtype']} · {report['model']}"
    sampling = report.get("sampling") or {}
    if sampling and Sampling(**sampling) != Sampling():
        title += " · " + " ".join(f"{k.replace('_', '-')} {v}" for k, v in sampling.items())
    table = Table(title=title)
    for col in ("batch", "tokens", "equal", "max |Δ|", "mean |Δ|", "KL k1", "KL k3"):
        table.add_column(col, justify="right")
    rows = list(report["per_batch_size"].items()) + [("all", report)]
    for name, s in rows:
        table.add_row(
            str(name), str(s["tokens_compared"]), f"{s['bitwise_equal_fraction']:.4f}",
            f"{s['max_abs_diff']:.2e}", f"{s['mean_abs_diff']:.2e}", f"{s['kl_k1']:.2e}",
            f"{s['kl_k3']:.2e}",
        )
    console.print(table)


def run_check_command(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from rl.report import write_report

    args = validate(ns)
    # vLLM logs every engine detail at INFO; the checker's own table is the output here.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    console = Console()
    if args.env is not None:
        from rl.config import resolve_env
        from rl.env_check import run_env_check

        result = run_env_check(args, resolve_env(args.env), env_samples(args), rescore)
        console.print(f"env {args.env}: {result.report['trajectories']} trajectories, "
                      f"{result.report['turns_mean']:.2f} turns each, "
                      f"{result.report['tool_calls']} tool calls ({result.report['tool_errors']} errors), "
                      f"{result.report['observation_tokens']} observation tokens (masked, not compared)")
    else:
        result = run_check(args)
    report = result.report
    print_table(report, console)
    if args.report:
        write_report(args.report, report, result.diffs)
        console.print(f"report: {args.report / 'report.json'}, {args.report / 'index.html'}")
    if report["passed"]:
        console.print(f"[green]PASS[/]: all {report['tokens_compared']} sampled tokens bit-identical")
        return 0
    verdict = f"{report['tokens_compared'] - report['tokens_equal']} of {report['tokens_compared']} tokens differ"
    if args.parity:
        console.print(f"[red]MISMATCH[/]: {verdict}")
        return 1
    console.print(f"parity off (stock engines): {verdict} — the mismatch the parity layer removes")
    return 0
