"""LoRA and weight sync into a running parity engine, on a real vLLM engine and a real Megatron
trainer (no mocks).

The trainer model gets an adapter with random non-zero B; its `rollout_tensors` go into the
engine with `set_adapter`, the engine samples, and the trainer re-scores the samples: every
log-prob is torch.equal. Checksums on the rollout side equal the XXH3-128 of what the trainer sent,
`clear_adapter` gives the base model back bitwise, and `update_weights` swaps full weights in
and out bitwise.

One engine per case (a module-scoped fixture): (llama, fp32) with vLLM's default
multiprocessing, and (qwen3, bf16) in-process (`multiprocess=False`), which covers both
architectures, both dtypes and both ways tensors reach the worker.
"""

from __future__ import annotations

import glob
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from parity.lora import TARGETS
from parity.model_spec import ModelSpec
from rollout.engine import RolloutEngine

CASES = [("llama", "fp32", True), ("qwen3", "bf16", False)]  # (arch, dtype, multiprocess)
RANK, ALPHA = 16, 32.0
PROMPT_LENS = (5, 17, 40, 70)  # 70 + MAX_TOKENS spans two attention KV blocks
MAX_TOKENS = 12
VOCAB_LOW, VOCAB_HIGH = 3, 500  # random ids that avoid the special tokens 0..2


def digest(tensor: torch.Tensor) -> str:
    """XXH3-128 of the tensor's bytes, computed here independently of parity.compare."""
    return xxhash.xxh3_128_hexdigest(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def randomize_adapter(model, seed: int, std: float, which: str = "B") -> None:
    """Overwrite lora_{which} of every adapter with N(0, std) draws (fixed seed), in place."""
    from trainer.megatron.lora import adapters

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, adapter in adapters(model):
            params = adapter.lora_B if which == "B" else adapter.lora_A
            for name in adapter.names:
                params[name].copy_(torch.randn(params[name].shape, generator=gen) * std)


def trainer_scores(model, completions) -> list[torch.Tensor]:
    """The trainer's log-probs of each completion's sampled tokens."""
    from trainer.megatron.logprobs import sequence_logprobs

    seqs = [c.prompt_ids + c.token_ids for c in completions]
    with torch.no_grad():
        return sequence_logprobs(model, seqs, [len(c.prompt_ids) for c in completions])


def base_scores(model, completions) -> list[torch.Tensor]:
    from trainer.megatron.lora import adapters_disabled

    with adapters_disabled(model):
        return trainer_scores(model, completions)


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(f"{model_dir}/*.safetensors")):
        weights.update(load_file(path))
    return weights


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{d}-{'mp' if m else 'inproc'}" for a, d, m in CASES])
def case(request, model_factory, megatron):
    from trainer.megatron.lora import apply_lora
    from trainer.megatron.model import load_model

    arch, dtype, multiprocess = request.param
    model_dir = model_factory(arch, dtype)
    trainer = load_model(model_dir, dtype, parity=True).eval()
    apply_lora(trainer, ModelSpec.from_dir(model_dir), RANK, ALPHA, list(TARGETS), seed=0)
    randomize_adapter(trainer, seed=1, std=0.05)
    engine = RolloutEngine(model_dir, dtype=dtype, max_model_len=256, multiprocess=multiprocess)
    rng = random.Random(0)
    try:
        yield SimpleNamespace(
            dir=model_dir, dtype=dtype, multiprocess=multiprocess, engine=engine,
            trainer=trainer, scaling=ALPHA / RANK,
            prompts=[[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)] for n in PROMPT_LENS],
        )
    finally:
        engine.close()
    # The session's Megatron state lives on: an in-process engine joined its process group.
    assert torch.distributed.is_initialized()


def push_adapter(case) -> dict[str, torch.Tensor]:
    from trainer.megatron.lora import rollout_tensors

    tensors = rollout_tensors(case.trainer)
    case.engine.set_adapter(tensors, case.scaling)
    return tensors


def assert_rollout_equals_trainer(case) -> list[torch.Tensor]:
    completions = case.engine.generate(case.prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    scores = trainer_scores(case.trainer, completions)
    for c, s in zip(completions, scores, strict=True):
        assert len(c.token_ids) == MAX_TOKENS
        assert torch.equal(c.rollout_logprobs, s)
    return completions


def test_adapter_rollout_equals_trainer(case):
    """Sampled with the adapter in vLLM == re-scored by the trainer with the adapter on, and the
    adapter matters: the same tokens score differently without it."""
    push_adapter(case)
    completions = assert_rollout_equals_trainer(case)
    with_adapter = trainer_scores(case.trainer, completions)
    for on, off in zip(with_adapter, base_scores(case.trainer, completions), strict=True):
        assert not torch.equal(on, off)


def test_adapter_checksums_equal_trainer_tensors(case):
    tensors = push_adapter(case)
    assert len(tensors) == 2 * len(TARGETS) * ModelSpec.from_dir(case.dir).num_layers
    assert case.engine.adapter_checksums() == {k: digest(v) for k, v in tensors.items()}


def _held_adapter_storage(worker) -> list[int]:
    """Worker side (in-process only): where the rollout model keeps its adapter tensors."""
    model = worker.model_runner.get_model()
    return [t.data_ptr() for m in model.modules() for pair in getattr(m, "pairs", {}).values() for t in pair]


def test_resync_after_a_training_step(case):
    """A changed adapter (as after an optimizer step) pushed again: parity and checksums hold.
    In-process, the re-sync copies into the tensors already held instead of allocating."""
    from trainer.megatron.lora import load_peft_state_dict, peft_state_dict

    push_adapter(case)
    storage = case.engine.llm.collective_rpc(_held_adapter_storage) if not case.multiprocess else None
    saved = {k: v.clone() for k, v in peft_state_dict(case.trainer).items()}
    try:
        randomize_adapter(case.trainer, seed=2, std=0.05)
        randomize_adapter(case.trainer, seed=3, std=0.05, which="A")
        tensors = push_adapter(case)
        assert case.engine.adapter_checksums() == {k: digest(v) for k, v in tensors.items()}
        assert_rollout_equals_trainer(case)
        if storage is not None:
            assert case.engine.llm.collective_rpc(_held_adapter_storage) == storage
    finally:
        load_peft_state_dict(case.trainer, saved)
    # An adapter that does not fit the attached targets is refused before any copy.
    first = next(iter(saved))
    for bad in ({k: v for k, v in saved.items() if k != first}, {**saved, first.replace("layers.0.", "layers.99."): saved[first]}):
        with pytest.raises(ValueError, match="the adapter does not fit this model's LoRA targets"):
            load_peft_state_dict(case.trainer, bad)


def test_packed_sync_rollout_equals_trainer(case):
    """The sync wire format (one flat buffer + index, what the training loop sends): parity,
    checksums and the buffer's digest on the first sync of a layout and on a re-sync into the held buffer; a
    dict-of-tensors set_adapter afterwards still works."""
    from parity.wire import pack_tensors
    from trainer.megatron.lora import load_peft_state_dict, peft_state_dict, rollout_tensors

    saved = {k: v.clone() for k, v in peft_state_dict(case.trainer).items()}
    try:
        for seed in (4, 5):  # first layout, then the same layout with new values
            randomize_adapter(case.trainer, seed=seed, std=0.05)
            tensors = rollout_tensors(case.trainer)
            flat, index = pack_tensors(tensors)
            case.engine.set_adapter_packed(flat, index, case.scaling)
            assert case.engine.adapter_checksums() == {k: digest(v) for k, v in tensors.items()}
            # One digest of the held buffer: the XXH3-128 of the buffer that was sent.
            assert case.engine.adapter_digest() == xxhash.xxh3_128_hexdigest(flat.tobytes())
            assert_rollout_equals_trainer(case)
        bad = dict(tensors)
        name = next(iter(bad))
        bad[name] = bad[name].float() if bad[name].dtype != torch.float32 else bad[name].double()
        with pytest.raises(ValueError):
            case.engine.set_adapter_packed(*pack_tensors(bad), case.scaling)
    finally:
        load_peft_state_dict(case.trainer, saved)
    push_adapter(case)
    assert_rollout_equals_trainer(case)


def test_clear_adapter_restores_base(case):
    push_adapter(case)
    case.engine.clear_adapter()
    assert case.engine.adapter_checksums() == {}
    completions = case.engine.generate(case.prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    for c, s in zip(completions, base_scores(case.trainer, completions), strict=True):
        assert torch.equal(c.rollout_logprobs, s)


def test_invalid_adapter_is_refused(case):
    """Refused with ValueError in the caller's process, and the held adapter stays."""
    tensors = push_adapter(case)
    held = case.engine.adapter_checksums()
    name = next(iter(tensors))
    other_dtype = torch.bfloat16 if case.dtype == "fp32" else torch.float32
    bad = [
        ({**tensors, name: tensors[name].to(other_dtype)}, "dtype"),
        ({k: v for k, v in tensors.items() if k != name}, "needs lora_A and lora_B"),
        ({**tensors, name: tensors[name][:, :-1]}, "are not"),
        ({**tensors, name.replace("layers.0", "layers.99"): tensors[name]}, "layers"),
        ({"lora_A.weight": tensors[name]}, "not a peft LoRA tensor name"),
    ]
    for adapter, message in bad:
        with pytest.raises(ValueError, match=message):
            case.engine.set_adapter(adapter, case.scaling)
    with pytest.raises(ValueError, match="finite"):
        case.engine.set_adapter(tensors, float("nan"))
    assert case.engine.adapter_checksums() == held


def test_update_weights_round_trip(case, tmp_path):
    """Full weights pushed by HF name: the engine then computes the new model (== a trainer
    built from the same weights), its checksums are those of what was sent; the originals
    pushed back restore the log-probs bitwise."""
    from trainer.megatron.logprobs import sequence_logprobs
    from trainer.megatron.model import load_model

    engine = case.engine
    engine.clear_adapter()
    original = checkpoint(case.dir)
    gen = torch.Generator().manual_seed(4)
    modified = {
        k: (v.float() + 0.02 * torch.randn(v.shape, generator=gen)).to(v.dtype) for k, v in original.items()
    }
    seqs = [p + p[:8] for p in case.prompts]
    before = engine.prompt_logprobs(seqs)
    assert engine.weight_checksums() == {k: digest(v) for k, v in original.items()}
    try:
        engine.update_weights(modified)
        assert engine.weight_checksums() == {k: digest(v) for k, v in modified.items()}
        after = engine.prompt_logprobs(seqs)
        shutil.copy(f"{case.dir}/config.json", tmp_path / "config.json")
        save_file(modified, str(tmp_path / "model.safetensors"))
        other = load_model(tmp_path, case.dtype, parity=True).eval()
        with torch.no_grad():
            expected = sequence_logprobs(other, seqs, [1] * len(seqs))
        for b, a, e in zip(before, after, expected, strict=True):
            assert not torch.equal(a, b)
            assert torch.equal(a, e)
    finally:
        engine.update_weights(original)
    assert engine.weight_checksums() == {k: digest(v) for k, v in original.items()}
    for b, a in zip(before, engine.prompt_logprobs(seqs), strict=True):
        assert torch.equal(a, b)


def test_invalid_weights_are_refused(case):
    """Refused with ValueError before vLLM's reload starts, and the model is untouched."""
    from trainer.megatron.logprobs import sequence_logprobs
    from trainer.megatron.lora import adapters_disabled

    engine = case.engine
    engine.clear_adapter()
    weights = checkpoint(case.dir)
    held = engine.weight_checksums()
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = [
        ({q: weights[q]}, "missing"),
        ({q: weights[q][:, :-1]}, "shape"),
        ({"model.layers.0.mlp.experts.weight": weights[q]}, "unexpected weight"),
    ]
    for named, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.update_weights(named)
    assert engine.weight_checksums() == held
    seq = case.prompts[1]
    with torch.no_grad(), adapters_disabled(case.trainer):
        expected = sequence_logprobs(case.trainer, [seq], [1])[0]
    assert torch.equal(engine.prompt_logprobs([seq])[0], expected)


def test_reserved_adapter_takes_every_sync_in_place(model_factory, megatron):
    """An engine that reserves its adapter at start (what CUDA graphs need: rollout/sync.py,
    reserve_adapter): a zero adapter in the trainer's layout before any sync; every sync, packed
    or by dict, copies into the same storage, and rollout == trainer bitwise each time; another
    scaling, another layout and clear_adapter are refused and leave the held adapter."""
    from parity.lora import AdapterLayout
    from parity.wire import pack_tensors
    from trainer.megatron.lora import apply_lora, rollout_tensors
    from trainer.megatron.model import load_model

    model_dir = model_factory("llama", "bf16")
    targets = ("q_proj", "v_proj", "o_proj", "down_proj")  # fused linears with parts left out too
    trainer = load_model(model_dir, "bf16", parity=True).eval()
    apply_lora(trainer, ModelSpec.from_dir(model_dir), RANK, ALPHA, list(targets), seed=0)
    layout = AdapterLayout(RANK, targets, ALPHA / RANK)
    engine = RolloutEngine(model_dir, dtype="bf16", max_model_len=256, multiprocess=False, adapter_layout=layout)
    rng = random.Random(0)
    case = SimpleNamespace(
        engine=engine, trainer=trainer, scaling=layout.scaling, multiprocess=False,
        prompts=[[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)] for n in PROMPT_LENS],
    )
    try:
        fresh = rollout_tensors(trainer)
        held = engine.adapter_checksums()
        assert list(held) == list(fresh)  # the trainer's order, so the wire index is the reserved one
        assert all(held[k] == digest(torch.zeros_like(v)) for k, v in fresh.items())
        storage = engine.llm.collective_rpc(_held_adapter_storage)
        for seed in (1, 2):
            randomize_adapter(trainer, seed=seed, std=0.05)
            tensors = rollout_tensors(trainer)
            engine.set_adapter_packed(*pack_tensors(tensors), layout.scaling)
            assert engine.adapter_checksums() == {k: digest(v) for k, v in tensors.items()}
            assert_rollout_equals_trainer(case)
            assert engine.llm.collective_rpc(_held_adapter_storage) == storage
        randomize_adapter(trainer, seed=3, std=0.05, which="A")
        push_adapter(case)
        assert_rollout_equals_trainer(case)
        assert engine.llm.collective_rpc(_held_adapter_storage) == storage
        held = engine.adapter_checksums()
        tensors = rollout_tensors(trainer)
        with pytest.raises(ValueError, match="scaling"):
            engine.set_adapter_packed(*pack_tensors(tensors), 2 * layout.scaling)
        with pytest.raises(ValueError, match="reserved"):
            engine.set_adapter_packed(*pack_tensors({k: v for k, v in tensors.items() if "v_proj" not in k}), layout.scaling)
        with pytest.raises(ValueError, match="reserved"):
            engine.clear_adapter()
        assert engine.adapter_checksums() == held
    finally:
        engine.close()
