"""The Kimi model (the tiny kimi-mini preset, which writes kimi-linear) on the Megatron trainer
(trainer/megatron/kimi.py): HF <-> Megatron conversion, the rollout's
parameter names, bitwise agreement with a plain loop over parity/kimi.py on the HF weights,
padding invariance, LoRA (neutral when fresh, peft names) and a GRPO step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from parity import kernels
from parity import kimi as pk
from parity.model_spec import KimiSpec, load_spec
from rl.config import AlgorithmConfig, LoraConfig, TrainerConfig
from trainer.checkpoint import peft_config, save_peft
from trainer.megatron import lora as lora_lib
from trainer.megatron.convert import hf_to_megatron, megatron_to_hf, megatron_to_rollout
from trainer.megatron.kimi import routing_trace
from trainer.megatron.logprobs import sequence_logprobs
from trainer.megatron.model import load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGETS = list(pk.LORA_TARGETS)


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lengths]


# --- a plain loop over parity/kimi.py on the HF weights (what the rollout model computes) -------


Lora = tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]  # ({HF path: (A, B)}, scaling)


def _linear(weight: torch.Tensor, path: str = "", spec: KimiSpec | None = None, lora: Lora | None = None):
    if lora is None:
        return lambda x: kernels.linear(x, weight)
    parts = pk.lora_linears(spec).get(path, (0, ((path, weight.shape[0]),)))[1]
    pairs = {p: lora[0][p] for p, _ in parts if p in lora[0]}
    return lambda x: pk.adapted_linear(x, weight, parts, pairs, lora[1])


def _ffn(w: dict, prefix: str, spec: KimiSpec, lora: Lora | None, names=("gate_proj", "up_proj", "down_proj")
         ) -> SimpleNamespace:
    gate, up, down = names
    gate_up = torch.cat([w[prefix + gate + ".weight"], w[prefix + up + ".weight"]], 0)
    return SimpleNamespace(
        gate_up_proj=_linear(gate_up, prefix + "gate_up_proj", spec, lora),
        down_proj=_linear(w[prefix + down + ".weight"], prefix + down, spec, lora),
    )


def _pairs(peft: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """peft tensors -> {HF module path: (A, B)}."""
    paths = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for k in peft if ".lora_A." in k}
    return {p: (peft[pk.peft_name(p, "A")], peft[pk.peft_name(p, "B")]) for p in paths}


def reference_logprobs(
    w: dict[str, torch.Tensor], spec: KimiSpec, ids: list[int], lora: Lora | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(log p(ids[j + 1] | ids[:j + 1]), routing trace) for one sequence, layer by layer
    through parity.kimi, with an optional LoRA adapter as the rollout applies it."""
    s, eps = len(ids), spec.rms_norm_eps
    tokens = torch.tensor(ids)
    x = torch.nn.functional.embedding(tokens, w["model.embed_tokens.weight"])
    pos, seq = torch.arange(s), torch.zeros(s, dtype=torch.long)
    trace = {}
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        lin = {n: _linear(t, n.removesuffix(".weight"), spec, lora)
               for n, t in w.items() if n.startswith(a) and t.dim() == 2}
        h = kernels.rms_norm(x, w[p + "input_layernorm.weight"], eps)
        if kind == "kda":
            names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")
            conv = torch.cat([w[f"{a}{c}_conv1d.weight"].flatten(1) for c in "qkv"])
            m = SimpleNamespace(
                **{n: lin[a + n + ".weight"] for n in names},
                conv1d=SimpleNamespace(weight=conv), dt_bias=w[a + "dt_bias"],
                A_log=w[a + "A_log"], o_norm=SimpleNamespace(weight=w[a + "o_norm.weight"]),
            )
            conv = torch.zeros(1, spec.kda_conv_size - 1, spec.kda_conv_channels)
            state = torch.zeros(1, spec.kda_num_heads, spec.kda_head_dim, spec.kda_head_dim)
            out = pk.kda_mixer(m, spec, h, [s], conv, state)[0]
        else:
            ix = a + "indexer."
            m = SimpleNamespace(
                **{n: lin[a + n + ".weight"] for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")},
                q_a_layernorm=SimpleNamespace(weight=w[a + "q_a_layernorm.weight"]),
                kv_a_layernorm=SimpleNamespace(weight=w[a + "kv_a_layernorm.weight"]),
                indexer=SimpleNamespace(
                    **{n: lin[f"{ix}{n}.weight"] for n in ("wq_b", "wk", "weights_proj")},
                    k_norm=SimpleNamespace(weight=w[ix + "k_norm.weight"], bias=w[ix + "k_norm.bias"]),
                ),
            )
            q, entry, iq, iw = pk.mla_entries(m, spec, h, pos)
            ctx = entry.view(1, s, -1)
            selected, count = pk.indexer_topk(spec, iq, iw, ctx[..., -spec.index_head_dim :], seq, pos)
            out = pk.mla_attend(m, spec, q, ctx, seq, selected, count)
            trace[f"layers.{i}.self_attn.selected"] = selected
        x = x + out
        b = p + "block_sparse_moe."
        moe = SimpleNamespace(
            gate=SimpleNamespace(weight=w[b + "gate.weight"], e_score_correction_bias=w[b + "gate.e_score_correction_bias"]),
            experts=[_ffn(w, f"{b}experts.{e}.", spec, lora, ("w1", "w3", "w2")) for e in range(spec.n_routed_experts)],
            shared_experts=_ffn(w, b + "shared_experts.", spec, lora),
        )
        out, trace[f"layers.{i}.mlp.experts"] = pk.moe(
            moe, spec, kernels.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        )
        x = x + out
    x = kernels.rms_norm(x, w["model.norm.weight"], eps)
    logits = kernels.linear(x, w["model.embed_tokens.weight"])
    return kernels.token_logprobs(logits[:-1], tokens[1:]).float(), trace


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def kimi(request, model_factory, megatron):
    """(dtype name, checkpoint path, loaded eval model) for the tiny kimi-mini."""
    path = model_factory("kimi-mini", request.param)
    return request.param, path, load_model(path, request.param, parity=True).eval()


# --- conversion ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kimi_hf_megatron_round_trip_is_bitwise(model_factory, dtype):
    path = model_factory("kimi-mini", dtype)
    spec = load_spec(path)
    assert isinstance(spec, KimiSpec)
    hf = load_file(f"{path}/model.safetensors")
    back = megatron_to_hf(hf_to_megatron(hf, spec), spec)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_kimi_rollout_names_are_hf_with_fused_experts(kimi):
    _, path, model = kimi
    spec = load_spec(path)
    state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    rollout = megatron_to_rollout(state, spec)
    expected = set()
    conv = {f"{c}_conv1d.weight": "conv1d.weight" for c in "qkv"}
    fused = {".gate_proj.": ".gate_up_proj.", ".up_proj.": ".gate_up_proj.", ".w1.": ".gate_up_proj.",
             ".w3.": ".gate_up_proj.", ".w2.": ".down_proj."}
    for name in pk.hf_weight_shapes(spec):
        for old, new in {**conv, **fused}.items():
            name = name.replace(old, new)
        expected.add(name)
    assert set(rollout) == expected
    assert "lm_head.weight" not in rollout  # tied
    hf = load_file(f"{path}/model.safetensors")
    for name, tensor in rollout.items():
        prefix = name.rsplit(".", 2)[0] + "."
        routed = ".experts." in name
        if name.endswith("gate_up_proj.weight"):
            gate, up = ("w1", "w3") if routed else ("gate_proj", "up_proj")
            want = torch.cat([hf[prefix + gate + ".weight"], hf[prefix + up + ".weight"]], 0)
        elif name.endswith("down_proj.weight") and routed:
            want = hf[prefix + "w2.weight"]
        elif name.endswith("conv1d.weight"):
            want = torch.cat([hf[f"{prefix}{c}_conv1d.weight"].flatten(1) for c in "qkv"])
        else:
            want = hf[name]
        assert torch.equal(tensor, want), name


def test_kimi_megatron_parameter_names(kimi):
    names = {n for n, _ in kimi[2].named_parameters()}
    for name in ("decoder.layers.3.self_attention.linear_q_down_proj.weight",
                 "decoder.layers.3.self_attention.linear_q_up_proj.weight",
                 "decoder.layers.3.self_attention.indexer.linear_wq_b.weight",
                 "decoder.layers.0.self_attention.linear_g_a_proj.weight",
                 "decoder.layers.0.mlp.router.e_score_correction_bias",
                 "decoder.layers.3.self_attention.linear_kv_down_proj.weight",
                 "decoder.layers.3.self_attention.kv_layernorm.weight",
                 "decoder.layers.3.self_attention.linear_kv_up_proj.weight",
                 "decoder.layers.3.self_attention.indexer.linear_wk.weight",
                 "decoder.layers.0.self_attention.conv1d.weight",
                 "decoder.layers.0.mlp.router.weight",
                 "decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight",
                 "decoder.layers.0.mlp.shared_experts.linear_fc2.weight"):
        assert name in names, name


# --- forward --------------------------------------------------------------------------------------


def test_kimi_trainer_matches_the_parity_reference_loop(kimi):
    """Bitwise the plain parity.kimi loop on the HF weights: guards conversion and wiring."""
    dtype, path, model = kimi
    spec = load_spec(path)
    hf = load_file(f"{path}/model.safetensors")
    for ids in _seqs((70, 5)):
        with torch.no_grad():
            got = sequence_logprobs(model, [ids], [1])[0]
            want, trace = reference_logprobs(hf, spec, ids)
        assert torch.equal(got, want)
        got_trace = routing_trace(model, torch.tensor([ids]))[0]
        assert got_trace.keys() == trace.keys()
        assert all(torch.equal(got_trace[k], t) for k, t in trace.items())


def test_kimi_padding_and_batch_do_not_change_bits(kimi):
    _, _, model = kimi
    lengths = (70, 1 + 1, 33, 9, 64, 65, 17, 3, 50, 41, 12, 28, 7, 66, 20, 2)  # 16 sequences
    seqs = _seqs(lengths, seed=1)
    with torch.no_grad():
        alone = [sequence_logprobs(model, [s], [1])[0] for s in seqs[:4]]
        batched = sequence_logprobs(model, seqs, [1] * len(seqs), batch_size=16)
        prefix = sequence_logprobs(model, [seqs[0][:40]], [1])[0]
    for a, b in zip(alone, batched[:4], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(prefix, alone[0][:39])


def test_kimi_routing_trace_is_batch_invariant(kimi):
    _, path, model = kimi
    spec = load_spec(path)
    seqs = _seqs((40, 9, 25), seed=2)
    ids = torch.zeros(3, 40, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    batch = routing_trace(model, ids)
    mla = [i for i, t in enumerate(spec.layer_types) if t == "mla"]
    expected_keys = {f"layers.{i}.mlp.experts" for i in range(spec.num_layers)}
    expected_keys |= {f"layers.{i}.self_attn.selected" for i in mla}
    for r, s in enumerate(seqs):
        alone = routing_trace(model, torch.tensor([s]))[0]
        assert set(alone) == expected_keys
        for key, t in alone.items():
            assert t.dtype == torch.int64
            assert torch.equal(batch[r][key][: len(s)], t), key
    sel = batch[0][f"layers.{mla[0]}.self_attn.selected"]
    assert sel.shape == (40, spec.index_topk)
    # Position t selects min(t + 1, topk) positions <= t, ascending; unused ranks are 0.
    assert torch.equal(sel[3], torch.tensor([0, 1, 2, 3] + [0] * (spec.index_topk - 4)))
    assert (sel[39].diff() > 0).all() and sel[39].max() <= 39
    assert batch[0]["layers.0.mlp.experts"].shape == (40, spec.num_experts_per_tok)


def test_kimi_gradients_reach_every_trained_weight(model_factory, megatron):
    model = load_model(model_factory("kimi-mini"), "fp32").train()
    ids = _seqs((20, 20), seed=3)
    torch.stack(sequence_logprobs(model, ids, [1, 1])).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    # The indexer only ranks keys and the routing bias only picks experts (discrete top-ks):
    # nothing differentiable reaches them, nor an expert no token was routed to.
    no_grad = {n for n in grads if ".indexer." in n or n.endswith("e_score_correction_bias")}
    trace = routing_trace(model, torch.tensor(ids))
    for i in range(len(model.decoder.layers)):
        chosen = set(torch.cat([t[f"layers.{i}.mlp.experts"].flatten() for t in trace]).tolist())
        unused = {n for n in grads if any(f"decoder.layers.{i}.mlp.experts.local_experts.{e}." in n
                                          for e in set(range(model.kimi_spec.n_routed_experts)) - chosen)}
        assert all(grads[n] is None for n in unused)
        no_grad |= unused
    for n, g in grads.items():
        if n not in no_grad:
            assert g is not None and torch.isfinite(g).all(), n
    assert grads["decoder.layers.0.self_attention.A_log"].abs().sum() > 0
    assert grads["decoder.layers.3.self_attention.linear_kv_up_proj.weight"].abs().sum() > 0


# --- LoRA -----------------------------------------------------------------------------------------


def test_kimi_lora_fresh_is_neutral_nonzero_b_changes_and_names_are_peft(model_factory, megatron, tmp_path):
    path = model_factory("kimi-mini", "bf16")
    spec = load_spec(path)
    model = load_model(path, "bf16").eval()
    seqs = _seqs((30, 12), seed=4)
    with torch.no_grad():
        base = sequence_logprobs(model, seqs, [1, 1])
    lora_lib.apply_lora(model, spec, 4, 8.0, TARGETS, seed=0)
    expected = {pk.peft_name(part, which)
                for _, parts in pk.lora_linears(spec).values() for part, _ in parts
                for which in ("A", "B")}
    state = lora_lib.peft_state_dict(model)
    assert set(state) == expected
    assert all(t.dtype == torch.float32 for t in state.values())  # fp32 masters
    assert all(t.dtype == torch.bfloat16 for t in lora_lib.rollout_tensors(model).values())
    assert all(p.requires_grad == (".lora." in n) for n, p in model.named_parameters())
    with torch.no_grad():
        fresh = sequence_logprobs(model, seqs, [1, 1])
    assert all(torch.equal(a, b) for a, b in zip(base, fresh, strict=True))

    g = torch.Generator().manual_seed(5)
    moved = {k: (torch.randn(v.shape, generator=g) * 0.05 if ".lora_B." in k else v) for k, v in state.items()}
    lora_lib.load_peft_state_dict(model, moved)
    assert all(torch.equal(lora_lib.peft_state_dict(model)[k], v) for k, v in moved.items())
    with torch.no_grad():
        adapted = sequence_logprobs(model, seqs, [1, 1])
        with lora_lib.adapters_disabled(model):
            disabled = sequence_logprobs(model, seqs, [1, 1])
    assert not torch.equal(adapted[0], base[0])
    # The adapter as the rollout applies it (rollout tensors: the model dtype) gives the same bits.
    hf = load_file(f"{path}/model.safetensors")
    want, _ = reference_logprobs(hf, spec, seqs[0], (_pairs(lora_lib.rollout_tensors(model)), 8.0 / 4))
    assert torch.equal(adapted[0], want)
    save_peft(tmp_path, lora_lib.rollout_tensors(model), peft_config(4, 8.0, TARGETS, path))
    assert set(load_file(str(tmp_path / "adapter_model.safetensors"))) == expected
    assert all(torch.equal(a, b) for a, b in zip(base, disabled, strict=True))

    # A subset of targets adapts only those parts (here the shared experts' gate only).
    other = load_model(path, "bf16")
    lora_lib.apply_lora(other, spec, 4, 8.0, ["gate_proj"], seed=0)
    names = set(lora_lib.peft_state_dict(other))
    assert names and all(".gate_proj." in n for n in names)


def test_kimi_grpo_step_with_lora_moves_the_adapter(model_factory, megatron):
    from trainer.megatron.policy import PolicyTrainer
    from trainer.step import Batch

    path = model_factory("kimi-mini", "fp32")
    trainer = PolicyTrainer(
        path, "fp32", True, LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=TARGETS),
        TrainerConfig(lr=1e-2, micro_batch_size=2), AlgorithmConfig(name="grpo"), seed=0,
    )
    seqs, starts = _seqs((20, 25, 18, 30), seed=6), [8, 10, 8, 12]
    before = trainer.logprobs(seqs, starts)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora." not in n}
    adapter = {k: v.clone() for k, v in trainer.rollout_tensors().items()}
    batch = Batch(seqs, starts, before, torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    stats = trainer.train_step(batch)
    assert stats["ppo/kl"] == 0.0 and stats["ppo/clipfrac"] == 0.0  # new == old bitwise
    assert torch.equal(torch.cat(trainer.last_old_logprobs()), torch.cat(before))
    after = trainer.rollout_tensors()
    assert after.keys() == adapter.keys()
    assert any(not torch.equal(after[k], adapter[k]) for k in after if ".lora_B." in k)
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if ".lora." not in n)
    gains = [(a - b).sum().item() for a, b in zip(trainer.logprobs(seqs, starts), before, strict=True)]
    assert gains[0] > 0 and gains[3] > 0, gains
    # The rollout full-weight sync names (trainer/megatron/worker.py) hold for kimi too.
    state = {k: v for k, v in trainer.model.state_dict().items() if torch.is_tensor(v) and ".lora." not in k}
    assert "model.layers.0.block_sparse_moe.experts.0.gate_up_proj.weight" in megatron_to_rollout(state, trainer.spec)


def test_kimi_ppo_critic_reads_final_hidden(model_factory, megatron):
    from trainer.megatron.policy import PolicyTrainer
    from trainer.step import Batch

    trainer = PolicyTrainer(
        model_factory("kimi-mini", "fp32"), "fp32", True,
        LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=TARGETS),
        TrainerConfig(lr=1e-3, micro_batch_size=2), AlgorithmConfig(name="ppo", critic_lr=1e-2), seed=0,
    )
    seqs, starts = _seqs((14, 11), seed=7), [5, 4]
    values = trainer.values(seqs, starts)
    assert [v.numel() for v in values] == [9, 7] and all(torch.equal(v, torch.zeros_like(v)) for v in values)
    batch = Batch(seqs, starts, trainer.logprobs(seqs, starts), torch.tensor([1.0, 0.0]), group_size=1)
    stats = trainer.train_step(batch)
    assert stats["critic/grad_norm"] > 0
    assert any(v.abs().sum() > 0 for v in trainer.values(seqs, starts))


def test_kimi_full_fine_tune_step_exports_hf_weights(model_factory, megatron):
    from trainer.megatron.policy import PolicyTrainer
    from trainer.step import Batch

    path = model_factory("kimi-mini", "bf16")
    trainer = PolicyTrainer(path, "bf16", True, LoraConfig(enabled=False),
                            TrainerConfig(lr=1e-3, micro_batch_size=2), AlgorithmConfig(name="grpo"), seed=0)
    seqs, starts = _seqs((12, 16), seed=8), [4, 6]
    hf = load_file(f"{path}/model.safetensors")
    trainer.train_step(Batch(seqs, starts, trainer.logprobs(seqs, starts), torch.tensor([1.0, 0.0]), group_size=2))
    weights = trainer.rollout_tensors()
    assert weights.keys() == hf.keys()
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.q_proj.weight"])


def test_kimi_refuses_stock_megatron_and_tensor_parallel(model_factory, megatron):
    from trainer.megatron.kimi import build_kimi_gpt

    path = model_factory("kimi-mini")
    with pytest.raises(ValueError, match="parity=True"):
        load_model(path, "fp32", parity=False)
    with pytest.raises(ValueError, match="tensor parallel size 1"):
        build_kimi_gpt(load_spec(path), torch.float32, tp_size=2)
