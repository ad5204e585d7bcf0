"""What every rollout parity model does with a trainer -> rollout sync, written once.

`SyncedModel` is mixed into each vLLM parity model class (rollout/llama.py, rollout/kimi.py):
loading checkpoint weights (vLLM's `load_weights`, by the one name map of
parity/weights.py), holding a LoRA adapter (from a dict of peft-named tensors, or from the wire format of
parity/wire.py as one buffer whose views the linears compute from, so a re-sync is one copy),
dropping it, full-weight syncs by the model's own parameter names, and the checksums of all of
these. A model supplies only what differs by architecture:

    spec                                        its parity.model_spec spec (names: parity/weights.py)
    _adapter_pairs(tensors, scaling) -> pairs   check an adapter against the model (ValueError)
    _adapter_shapes(layout) -> {name: shape}    the tensors of a reserved adapter (reserve_adapter)
    _hold(pairs, scaling, copy)                 hand each linear its pairs (copies if copy)
    _held() -> [(peft name, tensor)]            the adapter tensors it holds now
    _adapter_linears() -> linears               the linears that hold adapter pairs

and, under tensor parallelism, `full_parameters` / `_full_shape` / `_local` (full tensors <->
this rank's shards; the defaults below are TP=1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from parity import kernels, weights
from parity.compare import tensor_checksum
from parity.lora import AdapterLayout
from parity.wire import (
    Index,
    as_bytes_tensor,
    digest,
    digest_tensors,
    empty_buffer,
    index_for,
    unpack_tensors,
)


class PackedWeight(nn.Module):
    """A module holding one plain parameter `.weight` [N, K] and its compiled-GEMM pack
    (parity.kernels.pack), made on the first forward that needs it and dropped by every write
    of the model's weights (SyncedModel._weights_changed): packed once per weight version, not
    once per call. Every write goes through SyncedModel (load_weights, vLLM's reload, the
    full-weight sync), which is what makes keeping the pack safe here."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        self.drop_pack()

    def pack(self) -> torch.Tensor | None:
        if not self._has_pack:
            self._pack, self._has_pack = kernels.pack(self.weight), True
        return self._pack

    def derived_pack(self, make: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(make(weight), its pack), made once per weight version like pack(): for a caller
        that always computes with the same function of the weight (a TP rank's vocabulary
        rows of a replicated tied embedding), instead of re-making both on every call."""
        if self._derived is None:
            derived = make(self.weight)
            self._derived = (derived, kernels.pack(derived))
        return self._derived

    def drop_pack(self) -> None:
        self._pack: torch.Tensor | None = None
        self._has_pack = False
        self._derived: tuple[torch.Tensor, torch.Tensor | None] | None = None


class SyncedModel:
    _packed: tuple[torch.Tensor, Index] | None = None  # the held adapter buffer, if packed
    _reserved: AdapterLayout | None = None  # the adapter form fixed at start (reserve_adapter)
    _packed_scaling: float | None = None  # the scaling the linears hold with _packed

    # --- per architecture ---------------------------------------------------------------------

    def _adapter_pairs(self, tensors: dict[str, torch.Tensor], scaling: float):
        raise NotImplementedError

    def _hold(self, pairs, scaling: float, *, copy: bool) -> None:
        raise NotImplementedError

    def _held(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def _adapter_shapes(self, layout: AdapterLayout) -> dict[str, tuple[int, ...]]:
        raise ValueError(f"{type(self).__name__} cannot reserve an adapter (Llama and Qwen3 can)")


    def _weights_changed(self) -> None:
        """Called before every write of the weights: the PackedWeight packs are dropped (and
        remade from the new weights by the next forward)."""
        for module in self.modules():
            if isinstance(module, PackedWeight):
                module.drop_pack()

    # --- tensor parallelism (TP=1 defaults) ----------------------------------------------------

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.named_parameters()

    def _full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        return tuple(param.shape)

    def _local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full

    # --- LoRA adapter ----------------------------------------------------------------------------

    def reserve_adapter(self, layout: AdapterLayout) -> None:
        """Hold a zero adapter of `layout` from now on, in one buffer on the model's device,
        for the whole run: every later sync copies into it (same pointers, same scaling), so
        CUDA graphs captured after this call compute with each synced adapter. A zero adapter
        is what the trainer's fresh LoRA computes too (B = 0: exact zeros added)."""
        index = index_for(self._adapter_shapes(layout), self.dtype)
        buf = empty_buffer(index, self._device())
        self._hold(self._adapter_pairs(unpack_tensors(buf, index), layout.scaling), layout.scaling, copy=False)
        self._packed, self._reserved, self._packed_scaling = (buf, index), layout, layout.scaling

    def set_adapter(self, tensors: dict[str, torch.Tensor], scaling: float) -> None:
        """Hold a LoRA adapter, replacing the previous one: `tensors` by peft name, in the model
        dtype; `scaling` = alpha / rank. Everything is checked before anything changes, so a bad
        adapter leaves the held one in place. The model holds copies (in-process, the caller's
        tensors may be the trainer's live parameters)."""
        pairs = self._adapter_pairs(tensors, scaling)
        if self._reserved is not None:
            buf, index = self._packed
            order = {name: i for i, (name, *_) in enumerate(index)}
            names = sorted(tensors, key=lambda n: order.get(n, len(order)))
            self._check_reserved(index_for({n: tuple(tensors[n].shape) for n in names}, self.dtype), index, scaling)
            with torch.no_grad():
                for name, view in unpack_tensors(buf, index).items():
                    view.copy_(tensors[name])
            return
        self._packed = None  # the held tensors are no longer views of a packed buffer
        with torch.no_grad():
            self._hold(pairs, float(scaling), copy=True)

    def set_adapter_packed(self, flat, index: Index, scaling: float) -> None:
        """set_adapter from the sync wire format (parity.wire): the adapter as one byte buffer
        plus an index. The model then holds one buffer in the same layout, every A and B a view
        into it, so a later sync with the same index is a single copy of the bytes."""
        if not math.isfinite(scaling):
            raise ValueError(f"scaling must be finite, got {scaling}")
        incoming = as_bytes_tensor(flat)
        # Across processes the index arrives as lists; compare and view with tuples.
        index = tuple((n, d, tuple(shape), o, b) for n, d, shape, o, b in index)
        held = self._packed
        if self._reserved is not None:
            self._check_reserved(index, held[1], scaling)
        if held is not None and held[1] == index and held[0].numel() == incoming.numel():
            held[0].copy_(incoming)
            if float(scaling) != self._packed_scaling:  # a walk over every linear: only on a change
                self._set_scaling(float(scaling))
                self._packed_scaling = float(scaling)
            return
        buf = incoming.to(self._device(), copy=True)
        pairs = self._adapter_pairs(unpack_tensors(buf, index), scaling)
        self._hold(pairs, float(scaling), copy=False)
        self._packed, self._packed_scaling = (buf, index), float(scaling)

    def _check_reserved(self, index: Index, reserved: Index, scaling: float) -> None:
        if index != reserved:
            raise ValueError(
                f"this engine reserved a LoRA adapter at start ({self._reserved}, {len(reserved)} tensors)"
                f" and takes only that form; this one has {len(index)} tensors in another layout"
            )
        if float(scaling) != self._reserved.scaling:
            raise ValueError(
                f"this engine reserved a LoRA adapter with scaling {self._reserved.scaling} at start"
                f" (CUDA graphs keep it); got {scaling}"
            )

    def _set_scaling(self, scaling: float) -> None:
        for linear in self._adapter_linears():
            linear.scaling = scaling

    def _adapter_linears(self):
        raise NotImplementedError

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def clear_adapter(self) -> None:
        """Drop the adapter: every linear takes the base path again, bitwise."""
        if self._reserved is not None:
            raise ValueError("this engine reserved a LoRA adapter at start (CUDA graphs): it cannot drop it")
        self._packed = None
        self._hold({}, 0.0, copy=False)

    def adapter_checksums(self) -> dict[str, str]:
        """parity.compare.tensor_checksum of each held adapter tensor, by peft name; empty without an adapter."""
        return {name: tensor_checksum(t) for name, t in self._held()}

    def adapter_digest(self) -> str:
        """parity.wire.digest of the held adapter: of its buffer when it came packed (one pass,
        what a sync verifies against the sender's digest of the same layout), else of the held
        tensors in _held() order."""
        if self._packed is not None:
            return digest(self._packed[0])
        return digest_tensors(t for _, t in self._held())

    # --- full weights ------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loader entry: copy HF-named checkpoint tensors into the fused parameters
        (parity/weights.py names them), in place, so it also serves vLLM's reload_weights.
        A fused tensor is packed once all its parts have arrived. Returns the names written."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        self._weights_changed()
        params = dict(self.named_parameters())
        from_hf = {n: w for w in weights.weight_map(self.spec) for n in w.hf}
        pending: dict[str, dict[str, torch.Tensor]] = {}  # fused name -> its parts so far
        loaded: set[str] = set()
        for name, tensor in named_tensors:
            if weights.IGNORED_HF.search(name):
                continue
            if name not in from_hf:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            w = from_hf[name]
            if w.rollout not in params:  # lm_head of a tied checkpoint: the embedding serves
                continue
            parts = pending.setdefault(w.rollout, {})
            parts[name] = tensor
            if len(parts) < len(w.hf):
                continue
            del pending[w.rollout]
            param = params[w.rollout]
            # the rank's shard (TP), else the tensor itself
            full = self._local(w.rollout, weights.pack(w, [parts[n] for n in w.hf], self.spec))
            if tuple(param.shape) != tuple(full.shape):
                raise ValueError(f"{w.rollout}: checkpoint shape {tuple(full.shape)} != {tuple(param.shape)}")
            # Through the parameter's weight_loader when vLLM installed one: its in-place reload
            # swaps parameters for meta tensors and copies what the wrapped loaders receive
            # back into the live storage. Otherwise a plain copy.
            with torch.no_grad():
                getattr(param, "weight_loader", default_weight_loader)(param, full)
            loaded.add(w.rollout)
        if pending:
            raise ValueError(f"incomplete fused weights in checkpoint: {sorted(pending)} "
                             f"(has {sorted(n for p in pending.values() for n in p)})")
        return loaded

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The held weights under their HF checkpoint names: the inverse of load_weights
        (fused tensors are unpacked, which moves bytes and changes none)."""
        yield from weights.to_hf(dict(self.full_parameters()), self.spec, "rollout").items()

    def update_params_packed(self, flat, index: Index) -> None:
        """Full-weight sync in the wire format, by this model's own parameter names and fused
        layouts (what the parity trainer holds, parity.weights.rename): one copy per parameter,
        no repacking. Everything is checked before anything is written. Under tensor
        parallelism the tensors are full (TP=1 layout) too: each worker copies its shard."""
        params = dict(self.named_parameters())
        tensors = unpack_tensors(flat, tuple((n, d, tuple(sh), o, b) for n, d, sh, o, b in index))
        for name, tensor in tensors.items():
            param = params.get(name)
            if param is None:
                raise ValueError(f"unknown parameter {name!r}")
            full_shape = self._full_shape(name, param)
            if tuple(tensor.shape) != full_shape or param.dtype != tensor.dtype:
                raise ValueError(
                    f"{name}: {tensor.dtype} {tuple(tensor.shape)}, the model holds "
                    f"{param.dtype} {full_shape}"
                )
        self._weights_changed()
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(self._local(name, tensor))

    def param_digest(self, names: list[str]) -> str:
        """parity.wire.digest_tensors of the named parameters in this order (full tensors under
        TP): equal to the digest of the full-weight bucket that wrote them."""
        params = dict(self.full_parameters())
        return digest_tensors(params[name] for name in names)

    def param_checksums(self) -> dict[str, str]:
        """tensor_checksum of every parameter, by this model's parameter name (fused layouts; full
        tensors under TP)."""
        return {name: tensor_checksum(p) for name, p in self.full_parameters()}

    def weight_checksums(self) -> dict[str, str]:
        """tensor_checksum of every held weight, by HF checkpoint name."""
        return {name: tensor_checksum(t) for name, t in self.hf_weights()}
