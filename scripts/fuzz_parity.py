"""Shape fuzzer: `kimi-rl parity check` on randomly drawn model shapes, real vLLM and Megatron.

Each trial draws an architecture (Llama, Qwen3, kimi-mini; Qwen3-MoE and kimi-linear with
--arch ...,qwen3-moe,kimi-linear),
a shape, a dtype, prompts of random lengths, batch sizes and a per-step token budget (chunked
prefill on), writes a random-init checkpoint, runs `kimi-rl parity check --parity on` on it in a
subprocess and records what fraction of sampled tokens got bit-identical log-probs on both
sides. Shapes are drawn off the usual multiples on purpose: head_dim any even value 8..256, GQA
groups 1..8, odd intermediate sizes and vocabularies, tied or untied embeddings, 1..4 layers;
kimi-mini draws its KDA/MLA layer pattern, experts, top-k and indexer top-k; qwen3-moe a Qwen3
shape plus experts, top-k, expert width, norm_topk_prob, decoder_sparse_step and
mlp_only_layers; kimi-linear (the published Kimi Linear format) its KDA/MLA pattern, widths,
experts in groups, the first layer dense or not, q_lora_rank, DeepSeek-V3.2's indexer (top-k,
heads, head dim) or none, Kimi K3's MLA output gate and the MLA cache format (auto or fp8),
with prompt lengths at the indexer's top-k and the 64-key block edges and a 32/64-token step
budget. Prints a table and writes JSON (one row per trial: shape, dtype, KV cache format,
batch sizes, prompt lengths, tokens, bitwise fraction).

    python scripts/fuzz_parity.py --trials 20 --seed 0 [--arch llama,qwen3,kimi-mini,qwen3-moe,kimi-linear] [--pinned]
        [--start I | --only I,J,...] [--isa-mix] [--draw-sampling] [--out bench_results/fuzz_parity.json]

Exit status 1 if any trial is not fully bitwise (or fails to run), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ARCHS = ("llama", "qwen3", "kimi-mini", "qwen3-moe", "kimi-linear")
# The default --arch list: the one the recorded streams (docs/fuzz_*.json) drew with. An arch
# added later is opt-in (--arch ...,qwen3-moe,kimi-linear), so trial i of an old seed draws
# what it drew.
DEFAULT_ARCHS = ("llama", "qwen3", "kimi-mini")
DTYPES = ("fp32", "bf16")
TOKENIZER_SIZE = 512  # rl.models' "tiny" tokenizer: a vocabulary is at least this large


@dataclass
class Trial:
    index: int
    arch: str
    dtype: str
    shape: dict
    batch_sizes: list[int]
    prompt_lens: list[int]
    max_tokens: int
    max_num_batched_tokens: int
    kv_cache_dtype: str = "auto"  # `parity check --kv-cache-dtype`: "fp8" only for kimi-linear draws
    tokens: int = 0
    bitwise_fraction: float = 0.0
    max_abs_diff: float | None = None
    seconds: float = 0.0
    error: str | None = None
    cpu_capability: str = ""  # torch's vector ISA on the machine that ran the trial (AVX2, AVX512)
    # --isa-mix: the compiled kernels' code path of each side ("" = the CPU's best, both sides)
    rollout_isa: str = ""
    trainer_isa: str = ""
    # --draw-sampling: the distribution both sides score (1.0 / 1.0 / 0 = plain sampling)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens the rollout's prefix cache served


def draw_dense(rng: random.Random, arch: str) -> dict:
    """A Llama/Qwen3 shape. Attention width is capped so one trial stays about a minute.
    transformers' LlamaConfig insists that hidden be a multiple of the head count (Qwen3's does
    not), so a Llama's drawn hidden size is rounded to one."""
    kv_heads = rng.randint(1, 4)
    group = rng.randint(1, 8)
    head_dim = 2 * rng.randint(4, 128)  # even (RoPE rotates halves), often not a multiple of 16
    while kv_heads * group * head_dim > 2048:
        head_dim = max(8, head_dim // 2 if head_dim // 2 % 2 == 0 else head_dim // 2 + 1)
        if kv_heads * group * head_dim > 2048:
            group = max(1, group - 1)
    heads = kv_heads * group
    hidden = rng.randint(8, 512)
    if arch == "llama":
        hidden = max(heads, round(hidden / heads) * heads)
    return dict(
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=rng.randint(8, 1024),
        num_hidden_layers=rng.randint(1, 4), vocab_size=rng.randint(TOKENIZER_SIZE, 1200),
        tie_word_embeddings=rng.random() < 0.5,
    )


def draw_kimi(rng: random.Random) -> dict:
    """kimi-mini overrides (`kimi-rl model init --set`, its old keys; it writes kimi-linear):
    layer pattern, widths, MoE, indexer."""
    layers = rng.randint(1, 4)
    experts = rng.randint(1, 12)
    return dict(
        hidden_size=rng.randint(8, 256), layer_types=[rng.choice(["kda", "mla"]) for _ in range(layers)],
        kda_num_heads=rng.randint(1, 6), kda_head_dim=rng.randint(4, 48),
        num_attention_heads=rng.randint(1, 6), kv_lora_rank=rng.randint(4, 96),
        qk_nope_head_dim=rng.randint(4, 48), qk_rope_head_dim=2 * rng.randint(2, 12),
        v_head_dim=rng.randint(4, 40), index_n_heads=rng.randint(1, 4),
        index_head_dim=rng.randint(4, 40), index_topk=rng.randint(1, 40),
        n_routed_experts=experts, num_experts_per_tok=rng.randint(1, min(experts, 4)),
        moe_intermediate_size=rng.randint(8, 200), n_shared_experts=rng.randint(0, 2),
    )


def draw_qwen3_moe(rng: random.Random) -> dict:
    """A Qwen3 shape plus a sparse MoE: experts, top-k, expert width, renormalisation, the
    sparse step and which layers stay dense (mlp_only_layers)."""
    shape = draw_dense(rng, "qwen3")
    layers, experts = shape["num_hidden_layers"], rng.randint(1, 12)
    shape.update(
        num_experts=experts, num_experts_per_tok=rng.randint(1, min(experts, 4)),
        moe_intermediate_size=rng.randint(8, 200), norm_topk_prob=rng.random() < 0.5,
        decoder_sparse_step=rng.randint(1, 2),
        mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))),
    )
    return shape


def draw_kimi_linear(rng: random.Random) -> dict:
    """kimi-linear overrides (`kimi-rl model init --arch kimi-linear --set`) in the published
    config's keys: the layer pattern as 1-based kda_layers / full_attn_layers, experts split into
    groups of >= 2 for the grouped top-k, and the indexer only with a query latent (q_lora_rank).
    kv_lora_rank is even and the indexer's head dims are even, so the cache entry width is.
    hidden_size // num_attention_heads is even: KimiLinearConfig has no head_dim, so
    transformers' RoPE check (in vLLM's config loader) takes that quotient for one."""
    layers = [rng.choice(["kda", "mla"]) for _ in range(rng.randint(1, 4))]
    experts = rng.randint(1, 12)
    groups = rng.choice([1] + [g for g in range(2, experts // 2 + 1) if experts % g == 0])
    topk_group = rng.randint(1, groups)
    heads, rope = rng.randint(1, 6), 2 * rng.randint(2, 12)
    nope = rng.randint(4, 48)
    hidden = rng.randint(8, 256)
    hidden += heads if hidden // heads % 2 else 0
    q_lora_rank = rng.choice([None, 32, 48, 64])
    index_topk = rng.choice([0, 4, 8, 16, 32]) if q_lora_rank else 0
    shape = dict(
        hidden_size=hidden, intermediate_size=rng.randint(8, 512), first_k_dense_replace=rng.randint(0, 1),
        linear_attn_config=dict(
            kda_layers=[i + 1 for i, t in enumerate(layers) if t == "kda"],
            full_attn_layers=[i + 1 for i, t in enumerate(layers) if t == "mla"],
            num_heads=rng.randint(1, 6), head_dim=rng.randint(4, 48), short_conv_kernel_size=4,
        ),
        num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=2 * rng.randint(2, 48),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=rng.randint(4, nope + rope),
        q_lora_rank=q_lora_rank, mla_use_output_gate=rng.random() < 0.5,
        num_experts=experts,
        num_experts_per_token=rng.randint(1, min(4, topk_group * (experts // groups))),
        moe_intermediate_size=rng.randint(8, 200), num_shared_experts=rng.randint(0, 2),
        num_expert_group=groups, topk_group=topk_group,
    )
    if index_topk:
        shape.update(index_topk=index_topk, index_n_heads=rng.choice([1, 2, 4, 8]),
                     index_head_dim=rng.choice([rope, 32, 64]))
    return shape


def kimi_linear_prompt_lens(rng: random.Random, index_topk: int) -> list[int]:
    """Prompt lengths at the edges that matter: one short of, at and one past the indexer's
    top-k (where it starts to select) and the 64-key attention block (63, 64, 65, 130), plus a
    random length or two."""
    edges = [63, 64, 65, 130] + ([n for n in (index_topk - 1, index_topk, index_topk + 1) if n > 0]
                                 if index_topk else [])
    lens = rng.sample(edges, rng.randint(2, 4)) + [rng.randint(1, 300) for _ in range(rng.randint(0, 2))]
    rng.shuffle(lens)
    return lens


def fix_kimi(shape: dict) -> dict:
    """Nudge a drawn kimi-mini shape into the constraints (v_head_dim <= qk head dim; a cache
    entry width divisible by 4: it fills the key and value halves of a vLLM cache slot, whose
    head_dim vLLM's RoPE check wants even) without leaving the drawn neighbourhood. kimi-mini
    writes kimi-linear with DeepSeek-V3.2's indexer: index_head_dim >= qk_rope_head_dim (its
    RoPE rotates that many), and hidden_size // num_attention_heads even (transformers' RoPE
    check reads it as KimiLinearConfig's head_dim). Idempotent, and fixing an already fixed
    shape gives the same as fixing the raw draw (recorded streams, tests/unit/test_fuzz_draws.py)."""
    shape["v_head_dim"] = min(shape["v_head_dim"], shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"])
    shape["index_head_dim"] = max(shape["index_head_dim"], shape["qk_rope_head_dim"])
    heads = shape["num_attention_heads"]
    shape["hidden_size"] += heads if shape["hidden_size"] // heads % 2 else 0
    width = shape["kv_lora_rank"] + shape["qk_rope_head_dim"] + shape["index_head_dim"]
    shape["index_head_dim"] += -width % 4
    return shape


# The shape that showed the vendor-GEMM wrapping failing (issue 13): Qwen3, head_dim not a
# multiple of 16, an odd GQA group, hidden not a multiple of 64, an odd vocabulary, tied
# embeddings, fp32; batch 1 gave 47 % of tokens bit-identical on an AVX2 machine.
ODD_QWEN3 = Trial(
    index=-1, arch="qwen3", dtype="fp32",
    shape=dict(hidden_size=200, num_attention_heads=6, num_key_value_heads=2, head_dim=40,
               intermediate_size=333, num_hidden_layers=2, vocab_size=777, tie_word_embeddings=True),
    batch_sizes=[1, 7, 24], prompt_lens=[3, 17, 60, 130, 250], max_tokens=16, max_num_batched_tokens=128,
)


def draw_kimi_linear_trial(rng: random.Random, index: int) -> Trial:
    shape = draw_kimi_linear(rng)
    return Trial(
        index=index, arch="kimi-linear", dtype=rng.choice(DTYPES), shape=shape,
        batch_sizes=sorted(rng.sample(range(1, 41), rng.randint(1, 3))),
        prompt_lens=kimi_linear_prompt_lens(rng, shape.get("index_topk", 0)),
        max_tokens=rng.randint(4, 16), max_num_batched_tokens=rng.choice([32, 64]),
        kv_cache_dtype=rng.choice(["auto", "fp8"]),
    )


def draw_trial(rng: random.Random, index: int, archs: list[str]) -> Trial:
    arch = rng.choice(archs)
    if arch == "kimi-linear":
        return draw_kimi_linear_trial(rng, index)
    if arch == "kimi-mini":
        shape = fix_kimi(draw_kimi(rng))
    else:
        shape = draw_qwen3_moe(rng) if arch == "qwen3-moe" else draw_dense(rng, arch)
    return Trial(
        index=index, arch=arch, dtype=rng.choice(DTYPES), shape=shape,
        batch_sizes=sorted(rng.sample(range(1, 41), rng.randint(1, 3))),
        prompt_lens=[rng.randint(1, 300) for _ in range(rng.randint(2, 6))],
        max_tokens=rng.randint(4, 16), max_num_batched_tokens=rng.choice([64, 128, 256]),
    )


def draw_conditions(trial: Trial, seed: int, isas: list[str], draw_sampling: bool) -> Trial:
    """The trial's code paths (two different ones of `isas`, when it has two) and sampling
    parameters, each from a generator of its own: the shape stream of a seed stays what it was
    without these flags, so old rows reproduce, and the sampling drawn does not depend on how
    many code paths the CPU has. (Rows recorded before avx512_bf16 joined drew the sampling
    after the code paths, from one generator.)"""
    if len(isas) > 1:
        trial.rollout_isa, trial.trainer_isa = random.Random(f"conditions:{seed}:{trial.index}").sample(isas, 2)
    if draw_sampling:
        rng = random.Random(f"sampling:{seed}:{trial.index}")
        trial.temperature = round(rng.uniform(0.5, 1.3), 2)
        trial.top_p = rng.choice([1.0, round(rng.uniform(0.7, 0.99), 2)])
        trial.top_k = rng.choice([0, rng.randint(1, 64)])
    return trial


def write_dense_model(arch: str, shape: dict, dtype: str, seed: int, out: Path) -> None:
    """A random-init Llama/Qwen3 checkpoint of `shape`, like `kimi-rl model init` writes."""
    import torch
    from transformers import AutoModelForCausalLM

    from parity.dtypes import dtype_string, torch_dtype
    from rl.models import build_tokenizer, model_config

    tokenizer = build_tokenizer(TOKENIZER_SIZE, 2048)
    base = model_config(arch, "tiny", shape["vocab_size"])
    fields = {**base.to_dict(), **shape}
    fields.pop("layer_types", None)  # derived from num_hidden_layers again
    if "num_experts" in shape:  # transformers keeps it as num_local_experts
        fields["num_local_experts"] = fields.pop("num_experts")
    config = type(base)(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch_dtype(dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    data = json.loads((out / "config.json").read_text())
    data.update(dtype=dtype_string(dtype), torch_dtype=dtype_string(dtype))
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_model(trial: Trial, seed: int, out: Path) -> None:
    if trial.arch in ("kimi-mini", "kimi-linear"):
        from rl.models import init_model

        init_model(arch=trial.arch, preset="tiny", seed=seed, out_dir=out, dtype=trial.dtype,
                   overrides=trial.shape)
    else:
        out.mkdir(parents=True)
        write_dense_model(trial.arch, trial.shape, trial.dtype, seed, out)


def run_trial(trial: Trial, seed: int, workdir: Path) -> Trial:
    import torch

    start = time.perf_counter()
    trial.cpu_capability = torch.backends.cpu.get_cpu_capability()
    model, report = workdir / "model", workdir / "report"
    prompts = workdir / "prompts.jsonl"
    prng = random.Random(seed)
    prompts.write_text("".join(
        json.dumps({"prompt_ids": [prng.randrange(3, TOKENIZER_SIZE) for _ in range(n)]}) + "\n"
        for n in trial.prompt_lens
    ))
    try:
        write_model(trial, seed, model)
    except Exception as e:  # a drawn shape the model builder rejects is a finding, not a crash
        trial.error = f"model init: {type(e).__name__}: {e}"
        return trial
    cmd = [
        sys.executable, "-m", "rl.cli", "parity", "check", "--model", str(model), "--dtype", trial.dtype,
        "--prompts", str(prompts), "--num-prompts", str(len(trial.prompt_lens)),
        "--max-tokens", str(trial.max_tokens), "--batch-sizes", ",".join(map(str, trial.batch_sizes)),
        "--max-num-batched-tokens", str(trial.max_num_batched_tokens), "--seed", str(seed),
        "--parity", "on", "--report", str(report), "--temperature", str(trial.temperature),
        "--top-p", str(trial.top_p), "--top-k", str(trial.top_k), "--kv-cache-dtype", trial.kv_cache_dtype,
    ]
    # A small KV cache: the trials' models are tiny, and several engines may share the machine.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    if trial.rollout_isa:  # the trainer (the CLI's process) on one path, the rollout on another
        from parity import native

        cmd += ["--rollout-isa", trial.rollout_isa]
        env.update(native.isa_environment(trial.trainer_isa))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    trial.seconds = round(time.perf_counter() - start, 1)
    result = report / "report.json"
    if not result.exists():
        lines = (proc.stderr + proc.stdout).splitlines()
        causes = [line.strip() for line in lines if "Error" in line or "error:" in line]
        trial.error = f"parity check exited {proc.returncode}: {' | '.join(causes[:2] + causes[-1:])}"
        return trial
    data = json.loads(result.read_text())
    trial.tokens = data["tokens_compared"]
    trial.bitwise_fraction = data["bitwise_equal_fraction"]
    trial.max_abs_diff = data["max_abs_diff"]
    trial.prefix_hit_tokens = data["prefix_cache"]["hit_tokens"]
    return trial


def kimi_linear_shape_text(s: dict) -> str:
    lac = s["linear_attn_config"]
    n = len(lac["kda_layers"]) + len(lac["full_attn_layers"])
    pattern = "".join("K" if i in lac["kda_layers"] else "M" for i in range(1, n + 1))
    index = f" idx{s['index_topk']}/{s['index_n_heads']}x{s['index_head_dim']}" if s.get("index_topk") else ""
    return (f"h{s['hidden_size']} {pattern}{' d1' if s['first_k_dense_replace'] else ''} "
            f"kda{lac['num_heads']}x{lac['head_dim']} mla{s['num_attention_heads']} r{s['kv_lora_rank']} "
            f"q{s['q_lora_rank'] or '-'}{' gate' if s['mla_use_output_gate'] else ''} e{s['num_experts']}/"
            f"top{s['num_experts_per_token']} g{s['topk_group']}/{s['num_expert_group']}{index}")


def shape_text(trial: Trial) -> str:
    s = trial.shape
    if trial.arch == "kimi-linear":
        return kimi_linear_shape_text(s)
    if trial.arch == "kimi-mini":
        pattern = "".join("K" if t == "kda" else "M" for t in s["layer_types"])
        return (f"h{s['hidden_size']} {pattern} kda{s['kda_num_heads']}x{s['kda_head_dim']} "
                f"mla{s['num_attention_heads']} r{s['kv_lora_rank']} e{s['n_routed_experts']}/"
                f"top{s['num_experts_per_tok']} idx{s['index_topk']}")
    moe = ""
    if trial.arch == "qwen3-moe":
        moe = (f" e{s['num_experts']}/top{s['num_experts_per_tok']} m{s['moe_intermediate_size']}"
               f"{' norm' if s['norm_topk_prob'] else ''} step{s['decoder_sparse_step']} dense{s['mlp_only_layers']}")
    return (f"h{s['hidden_size']} L{s['num_hidden_layers']} q{s['num_attention_heads']}/kv"
            f"{s['num_key_value_heads']} d{s['head_dim']} i{s['intermediate_size']} "
            f"v{s['vocab_size']}{' tied' if s['tie_word_embeddings'] else ''}{moe}")


def conditions_text(trial: Trial) -> str:
    isa = f"{trial.rollout_isa}/{trial.trainer_isa} " if trial.rollout_isa else ""
    return f"{isa}T{trial.temperature:g} p{trial.top_p:g} k{trial.top_k}"


def print_table(trials: list[Trial]) -> None:
    print(f"{'#':>3}  {'arch':11} {'dtype':5} {'kv':4} {'shape':58} {'batches':10} {'tokens':>6} {'bitwise':>8}  s")
    for t in trials:
        verdict = f"{t.bitwise_fraction:8.1%}" if t.error is None else "   ERROR"
        print(f"{t.index:>3}  {t.arch:11} {t.dtype:5} {t.kv_cache_dtype:4} {shape_text(t):58} "
              f"{','.join(map(str, t.batch_sizes)):10} {t.tokens:>6} {verdict}  {t.seconds:.0f}")
        if t.error:
            print(f"     {t.error}")
    ok = sum(t.error is None and t.bitwise_fraction == 1.0 for t in trials)
    print(f"{ok}/{len(trials)} trials bitwise; {sum(t.tokens for t in trials)} tokens compared")


def write_json(out: Path, seed: int, archs: list[str], done: list[Trial]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seed": seed, "archs": archs, "trials": [asdict(t) for t in done]}, indent=2) + "\n")


def fuzz(
    trials: int, seed: int, archs: list[str], start: int = 0, pinned: bool = False, out: Path | None = None,
    only: list[int] | None = None, isa_mix: bool = False, draw_sampling: bool = False,
) -> list[Trial]:
    """Trials start .. start+trials-1 of the stream drawn from `seed` (trial i always draws the
    same shape for a given seed and arch list, so a slice reproduces a longer run's rows), or
    just the indices in `only`, after the pinned ODD_QWEN3 case if `pinned`. The JSON at `out`
    is rewritten after every trial, so an interrupted run keeps what it measured."""
    rng = random.Random(seed)
    if only:
        drawn = [t for t in (draw_trial(rng, i, archs) for i in range(max(only) + 1)) if t.index in only]
    else:
        drawn = [draw_trial(rng, i, archs) for i in range(start + trials)][start:]
    if pinned:
        drawn.insert(0, Trial(**asdict(ODD_QWEN3)))
    if isa_mix or draw_sampling:
        from parity import native

        isas = native.cpu_isas() if isa_mix else []
        drawn = [draw_conditions(t, seed, isas, draw_sampling) for t in drawn]
    done = []
    for trial in drawn:
        with tempfile.TemporaryDirectory(prefix="fuzz-parity-") as tmp:
            done.append(run_trial(trial, seed * 100_003 + trial.index + 1, Path(tmp)))
        t = done[-1]
        print(f"trial {t.index}: {t.arch} {t.dtype} kv {t.kv_cache_dtype} {shape_text(t)} {conditions_text(t)} -> "
              f"{t.error or f'{t.bitwise_fraction:.1%} of {t.tokens}'} ({t.seconds:.0f} s)", flush=True)
        if out is not None:
            write_json(out, seed, archs, done)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first trial index of the seed's stream")
    parser.add_argument("--arch", default=",".join(DEFAULT_ARCHS),
                        help="comma-separated subset of " + ",".join(ARCHS) + " (default: " + ",".join(DEFAULT_ARCHS) + ")")
    parser.add_argument("--only", default="", help="comma-separated trial indices of the seed's stream to run")
    parser.add_argument("--pinned", action="store_true", help="also run the odd-shaped Qwen3 case of issue 13")
    parser.add_argument("--isa-mix", action="store_true",
                        help="each trial: the rollout on one compiled-kernel path, the trainer on another")
    parser.add_argument("--draw-sampling", action="store_true", help="each trial draws temperature, top-p, top-k")
    parser.add_argument("--out", default="bench_results/fuzz_parity.json")
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = sorted(set(archs) - set(ARCHS))
    if unknown or not archs:
        parser.error(f"--arch: unknown {', '.join(unknown) or '(empty)'}; expected a subset of {', '.join(ARCHS)}")
    only = [int(i) for i in args.only.split(",") if i.strip()]
    done = fuzz(args.trials, args.seed, archs, args.start, args.pinned, Path(args.out), only,
                isa_mix=args.isa_mix, draw_sampling=args.draw_sampling)
    print_table(done)
    print(f"wrote {args.out}")
    return 0 if all(t.error is None and t.bitwise_fraction == 1.0 for t in done) else 1


if __name__ == "__main__":
    sys.exit(main())
