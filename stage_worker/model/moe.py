"""Sparse MoE with a sigmoid-gated shared expert, and the plain SwiGLU MLP it is built from."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import ConfigError
from stage_worker.kernels.flags import NONE, KernelFlags
from stage_worker.kernels.moe_int4_ref import scale_columns
from stage_worker.kernels.moe_ref import count_ref
from stage_worker.model.activations import activation, is_silu
from stage_worker.model.expert_table import ExpertTable
from stage_worker.model.fused_rows import fuse_rows, still_fused
from stage_worker.model.quant_linear import PackedLinear, fuse_packed, still_fused_packed


class SwiGLU(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), `act` the config's hidden_act (SiLU in every released model)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.act = activation(act)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k (equal probabilities: lower expert id first), optional renormalisation."""
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = order.values[:, :top_k], order.indices[:, :top_k]
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


def balance_loss(logits: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer load balancing, as transformers' Qwen MoE models compute it: E * sum_e f_e * P_e, with f_e
    the share of the batch's (token, slot) selections that went to expert e and P_e the mean router probability of e.
    1.0 when routing is uniform; it pushes against a router that collapses onto a few experts."""
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.zeros(num_experts, device=logits.device).index_add_(
        0, ids.reshape(-1).long(), torch.ones(ids.numel(), device=logits.device))
    return num_experts * (counts / ids.numel() * probs.mean(0)).sum()


class SparseMoE(nn.Module):
    """Experts are stored fused per layer: w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I]."""

    kernels: KernelFlags = NONE
    # Training (tools/train_demo.py): when set to a list, each call appends ("moe_balance", loss).
    aux: list | None = None
    # Training: every expert runs on every token and unselected ones are weighted 0 (the same sum). At a small
    # model's sizes two GEMMs beat a loop over experts with a host sync by far; inference never sets it.
    dense_experts: bool = False
    # CUDA-graph capture (stage_worker/cuda_graphs.py): int32 [1] on the device, the replayed batch's real rows;
    # the router gives padding rows no routed expert, so they read no expert weights. None outside a capture.
    valid_rows: torch.Tensor | None = None
    # Tests: run the INT4 prefill kernels on CPU tensors under TRITON_INTERPRET=1 (moe_int4_prefill.py).
    interpret_on_cpu: bool = False
    # `expert_prefetch`: (the next MoE layer of the stage,) whose table this layer's decode predicts and copies
    # for (`set_prefetch_next`)
    _prefetch_to: tuple | None = None

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, shared_intermediate: int,
                 renormalise: bool, act: str = "silu") -> None:
        super().__init__()
        self.top_k, self.renormalise, self.num_experts = top_k, renormalise, num_experts
        self.act_name, self.act = act, activation(act)     # quantized experts compute SiLU (use_packed, use_fp8)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.shared_expert = SwiGLU(hidden, shared_intermediate, act) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_intermediate else None
        # routing trace hook: what the last call selected (slots when a table is set: `expert_ids` maps them)
        self.last_expert_ids: torch.Tensor | None = None
        self.table: ExpertTable | None = None
        self.packed_group = self.packed_group2 = 0   # > 0: INT4 experts, inputs per scale of w13 / w2 (use_packed)
        self.packed_fp4 = False                      # their words hold E2M1 codes (NVFP4 / MXFP4), not INT4
        self.fp8_block: tuple[int, int] | None = None  # float8 experts: (rows, columns) per scale (use_fp8)

    def set_prefetch_next(self, nxt: "SparseMoE | None") -> None:
        """`expert_prefetch`: at decode, predict the next MoE layer's host experts from this layer's input and copy
        them into its table's prefetch slots (`_prefetch_next`; `kernels/expert_prefetch.py`). Held in a tuple: a
        module attribute would make it a submodule (its weights twice in the state dict)."""
        self._prefetch_to = None if nxt is None else (nxt,)

    def use_table(self, table: ExpertTable) -> None:
        """Serve the routed experts from `table` (some in host RAM); w13/w2 (or, INT4 or float8 experts, the
        q13/s13/q2/s2 buffers) stop being module tensors. The router's rows must be put in slot order once loaded
        (`table.order_gate`)."""
        for name in table.parts:
            delattr(self, name)
        self.table = table

    def use_packed(self, group: int, group2: int, asym: bool = False, fp4: bool = False,
                   scale_dtype: torch.dtype | None = None) -> None:
        """Hold the routed experts as a checkpoint's INT4 words and scales (issue 17): q13 int32 [E, 2I, H/8],
        s13 [E, 2I, ceil(H/group)], q2 [E, H, I/8], s2 [E, H, ceil(I/group2)] (stage_worker/kernels/moe_int4_ref.py;
        `asym`: each scale row twice as wide, the zero points after the scales); w13/w2 stop being parameters. Built
        on the meta device and filled by the loader. `scale_dtype`: the checkpoint's (default the compute dtype):
        the references dequantize as the library does, (q - z) times the scale in the scale's dtype, so a bf16
        checkpoint computed in float32 on a CPU rounds its weights as there (in float32 scales they differed from
        the library's by up to 6e-4 in log-probabilities; PackedLinear keeps its scale dtype the same way). `fp4`:
        the words hold E2M1 codes and the scales are float32 (NVFP4 / MXFP4 checkpoints, `moe_int4_ref`)."""
        self._check_silu("FP4" if fp4 else "INT4", "packed_experts")
        E, two_i, H = self.w13.shape
        inter = two_i // 2
        dtype, device = torch.float32 if fp4 else scale_dtype or self.w13.dtype, self.w13.device
        del self.w13, self.w2
        self.register_buffer("q13", torch.empty(E, two_i, H // 8, dtype=torch.int32, device=device))
        self.register_buffer("s13", torch.empty(E, two_i, scale_columns(H, group, asym), dtype=dtype, device=device))
        self.register_buffer("q2", torch.empty(E, H, inter // 8, dtype=torch.int32, device=device))
        self.register_buffer("s2", torch.empty(E, H, scale_columns(inter, group2, asym), dtype=dtype, device=device))
        self.packed_group, self.packed_group2, self.packed_fp4 = group, group2, fp4

    def _check_silu(self, form: str, switch: str) -> None:
        """Kept-quantized experts compute SiLU only; with `switch` off the loader dequantizes them and they run
        any activation, which the message says (not only "use the checkpoint unquantized")."""
        if not is_silu(self.act_name):
            raise ConfigError(f"config field 'hidden_act': {form} experts are computed with SiLU only (got "
                              f"{self.act_name!r}); turn cluster key {switch} off (MOEPIPE_{switch.upper()}=0) to "
                              f"run them dequantized at load, or use the checkpoint unquantized")

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Hold the routed experts as a block-FP8 checkpoint's float8 bytes and scales (issue 17,
        `packed_fp8_experts`): q13 uint8 [E, 2I, H], s13 float32 [E, 2, ceil(I/br), ceil(H/bc)] (gate's blocks,
        up's), q2 uint8 [E, H, I], s2 float32 [E, ceil(H/br), ceil(I/bc)] (`kernels.moe_ref.Fp8Experts`); the
        same buffers the INT4 form uses, in a third form. uint8 storage, so no model-wide `.to(dtype)` can cast
        them. Built on the meta device and filled by the loader."""
        self._check_silu("float8", "packed_fp8_experts")
        E, two_i, H = self.w13.shape
        inter = two_i // 2
        br, bc = block
        device = self.w13.device
        del self.w13, self.w2
        self.register_buffer("q13", torch.empty(E, two_i, H, dtype=torch.uint8, device=device))
        self.register_buffer("s13", torch.empty(E, 2, -(-inter // br), -(-H // bc), dtype=torch.float32,
                                                device=device))
        self.register_buffer("q2", torch.empty(E, H, inter, dtype=torch.uint8, device=device))
        self.register_buffer("s2", torch.empty(E, -(-H // br), -(-inter // bc), dtype=torch.float32, device=device))
        self.fp8_block = (br, bc)

    def packed(self):
        """The INT4 experts as the kernels take them (without a table: `table.packed_experts()` has both tiers);
        float8 experts: `Fp8Experts` (with a table: `table.fp8_experts()`)."""
        if self.fp8_block:
            from stage_worker.kernels.moe_ref import Fp8Experts

            return Fp8Experts(self.q13, self.s13, self.q2, self.s2, self.fp8_block)
        from stage_worker.kernels.moe_int4_ref import PackedExperts

        return PackedExperts(self.q13, self.s13, self.q2, self.s2, self.packed_group, self.packed_group2,
                             self.packed_fp4)

    def expert_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """`last_expert_ids` (slots) as expert ids."""
        return ids if self.table is None else self.table.experts_of(ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_group or self.fp8_block:
            return self._forward_packed(x)
        t = self.table
        if self.kernels.moe and x.is_cuda:
            from stage_worker.kernels.moe import moe_forward

            w13, w2 = (self.w13, self.w2) if t is None else (t.w13, t.w2)
            tokens = x.numel() // x.shape[-1]
            extra = {} if t is None else {"host": t.host_rows(), "counts": t.route_counts(tokens, self.top_k),
                                          "slot_map": t.slot_map, "claim": t.claimed()}
            extra["valid"] = self.valid_rows
            # `expert_prefetch`: the prediction for the next layer beside this one's launches, joined after them
            predicted = self._prefetch_next(x.reshape(-1, x.shape[-1]))
            fused = self._fused_shared()
            if fused is not None:
                router, shared = fused
                out, self.last_expert_ids = moe_forward(x, router, w13, w2, self.top_k, self.renormalise,
                                                        shared, prefill_kernel=self.kernels.moe_prefill,
                                                        fused_router=self.kernels.fused_router, **extra)
            else:
                out, self.last_expert_ids = moe_forward(x, self.gate.weight, w13, w2, self.top_k,
                                                        self.renormalise, prefill_kernel=self.kernels.moe_prefill,
                                                        fused_router=self.kernels.fused_router, **extra)
                out = self._add_shared(x, out)
            if predicted is not None:
                self._prefetch_copy(predicted)
            return out
        logits = self.gate(x)
        weights, ids = route(logits, self.top_k, self.renormalise)
        self.last_expert_ids = ids
        if self.aux is not None and x.shape[0]:
            self.aux.append(("moe_balance", balance_loss(logits, ids, self.num_experts)))
        if self.dense_experts:
            if t is not None:
                raise RuntimeError("dense_experts (training) needs the experts as parameters, not a table")
            return self._add_shared(x, self._all_experts(x, weights, ids))
        by_expert = ids
        if t is not None:
            ids = t.slots_of(ids)
            self.last_expert_ids = ids           # slots, as on the kernel paths
            counts = t.route_counts(ids.shape[0], self.top_k)
            if counts is not None:
                count_ref(ids, counts)
                t.copy_claimed(ids)
            by_expert = t.experts_of(ids)        # experts in id order, as without a table: the same sums
            slot_of = t.slot_of_expert()
        out = torch.zeros_like(x)

        def expert_rows(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (self.w13[e], self.w2[e]) if t is None else \
                tuple(r.to(x.device, non_blocking=True) for r in t.slot_rows(slot_of[e]))

        if x.dim() == 2 and x.shape[0] == 1:
            # One token (a decode step of one sequence): its k experts in id order, as the loop below visits them, without the
            # loop's unique / where / gathers / index_add (~15 us of ~40 an expert on the CPU): the same sums.
            chosen = by_expert[0].tolist()
            for j in sorted(range(len(chosen)), key=chosen.__getitem__):
                w13, w2 = expert_rows(chosen[j])
                g, u = F.linear(x, w13).chunk(2, dim=-1)
                out += (F.linear(self.act(g) * u, w2) * weights[0, j]).to(out.dtype)
            return self._add_shared(x, out)
        for e in torch.unique(by_expert).tolist():
            tok, slot = torch.where(by_expert == e)
            w13, w2 = expert_rows(e)
            gate_up = F.linear(x[tok], w13)
            g, u = gate_up.chunk(2, dim=-1)
            y = F.linear(self.act(g) * u, w2) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return self._add_shared(x, out)

    def _forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        """INT4 experts: the router as always, then the INT4 decode kernels on a GPU (`moe_int4.fused_moe_int4`);
        prefill and the CPU take `_packed_prefill`. The shared expert runs beside them. With a table (cold experts,
        issue 16) the router counts its selections as for bf16 tables and decode reads host slots in the same
        launch. Float8 experts likewise, with the FP8 mode of the bf16 pair (`moe.fused_moe_fp8`)."""
        from stage_worker.kernels.moe_int4 import DECODE_MAX_TK

        x2 = x.reshape(-1, x.shape[-1])
        t = self.table
        counts = None if t is None else t.route_counts(x2.shape[0], self.top_k)
        if self.kernels.moe and self.kernels.moe_int4_fused and x.is_cuda and \
                x2.shape[0] * self.top_k <= DECODE_MAX_TK:
            fused = self._packed_decode(x2, counts)
            if fused is not None:
                return fused.view(x.shape)
        logits = self.gate(x2)
        if self.kernels.moe and x.is_cuda:
            from stage_worker.kernels.moe import route as route_kernel
            from stage_worker.kernels.common import triton_usable

            decode = x2.shape[0] * self.top_k <= DECODE_MAX_TK
            weights, ids = route_kernel(logits, self.top_k, self.renormalise, counts=counts,
                                        valid=self.valid_rows if decode else None,
                                        slot_map=None if t is None else t.slot_map)
            weights = weights.to(x.dtype)
            if not decode:
                out = self._packed_prefill(x2, ids, weights, self.kernels.moe_int4_prefill)
            elif t is None or triton_usable(x2):
                out = self._routed_decode(x2, ids, weights)
            else:
                t.copy_claimed(ids)                                         # the router's reference path claimed
                out = self._packed_prefill(x2, ids, weights, False)      # the table's per-expert loop
        else:
            decode = False
            weights, ids = route(logits, self.top_k, self.renormalise)
            if t is not None:
                ids = t.slots_of(ids)
            if counts is not None:
                count_ref(ids, counts)
                t.copy_claimed(ids)
            out = self._packed_prefill(x2, ids, weights, self.kernels.moe_int4_prefill and self.interpret_on_cpu)
        self.last_expert_ids = ids
        shared = self._packed_shared() if self.kernels.moe and x.is_cuda and decode else None
        if shared is not None:
            # the bf16 shared expert as the one slot of a bf16 fused-MoE launch pair: two Triton GEMVs at HBM speed
            # instead of cuBLAS's three small-N GEMVs and their elementwise ops (H200, full shape, 48 layers:
            # 0.94 ms of an 8.4 ms batch-1 step, bench/results/moe-int4-4)
            from stage_worker.kernels.moe import fused_moe

            gate = torch.sigmoid(self.shared_expert_gate(x2)).to(x.dtype)
            return (out + fused_moe(x2, torch.zeros_like(gate, dtype=torch.int32), gate, *shared)).view(x.shape)
        return self._add_shared(x2, out).view(x.shape)

    def _packed_decode(self, x2: torch.Tensor, counts) -> torch.Tensor | None:
        """INT4 decode in six launches: one GEMV for the router and the shared gate (`prepare_kernels` laid them
        out as one [E + 1, H] tensor), the router kernel (slot k: the shared expert, id -1, weight sigmoid of its
        gate), the shared expert's two launches, and the INT4 pair reading the router's first k slots in place and
        adding the shared expert's output in its down launch. A bf16 shared expert runs as the bf16 fused-MoE
        pair; one kept packed (a reports-mixed checkpoint's INT6) as two W6A16 GEMVs, gate and up as one packed
        weight, the down GEMV computing silu(gate) * up * its gate weight as it loads (`quant_gemv(swiglu=)`).
        The separate path took twelve to fifteen launches (the shared gate as a cuBLAS dot and reduction,
        sigmoid, ids filled, SiLU and products, the add, the weights' cast): ~1.4 us of launch gap each in a
        graph. None when the weights are not laid out so."""
        from stage_worker.kernels.moe import fused_moe, router_route, triton_usable
        from stage_worker.kernels.quant_gemv import quant_gemv

        router, shared, packed = self._packed_router(), self._packed_shared(), self._packed_shared_int()
        if router is None or (shared is None and packed is None) or not triton_usable(x2):
            return None
        k = self.top_k
        fma, wide = self.kernels.quant_gemv_fma, self.kernels.quant_gemv_wide
        # kernel flag `side_stream`: a packed shared expert's two GEMVs on a second stream, gate+up beside the router
        # GEMV and the router kernel, down (it needs the router's shared weight) beside the INT4 up launch; the INT4
        # down launch, which adds the shared output, waits for it. Each reads a few MB, too little to fill the GPU
        # alone; same launches, same results. Buffers made on the side stream are read there and (shared_out) by
        # main after its join; every side use forks from main first, so no block is reused while main still reads
        # it. The side GEMVs may split K (`split_reduce` counters): what overlaps them on main (cuBLAS, the router
        # kernel, the INT4 up launch) takes no counters.
        side = None
        if shared is None and self.kernels.side_stream and x2.is_cuda and not self.fp8_block:
            from stage_worker.kernels.common import side_stream

            main, side = torch.cuda.current_stream(x2.device), side_stream(x2.device)
        if side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                gate_up = quant_gemv(x2, packed[0], fma=fma, wide=wide)
        predicted = self._prefetch_next(x2)
        weights, ids = router_route(x2, router, k, self.renormalise, shared=True, counts=counts,
                                    valid=self.valid_rows, slot_map=None if self.table is None else self.table.slot_map,
                                    fused=self.kernels.fused_router)
        # fp32 router weights go in as they are (the INT4 kernels round them to x's dtype, the shared slot's is
        # already rounded by the router kernel): no cast launch
        if shared is not None:
            shared_out = fused_moe(x2, ids[:, k:], weights[:, k:], *shared)
        elif side is None:
            shared_out = quant_gemv(quant_gemv(x2, packed[0], fma=fma, wide=wide), packed[1], swiglu=weights[:, k],
                                    fma=fma, wide=wide)
        else:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared_out = quant_gemv(gate_up, packed[1], swiglu=weights[:, k], fma=fma, wide=wide)
        out = self._routed_decode(x2, ids[:, :k], weights[:, :k], add=shared_out,
                                  before_down=None if side is None else
                                  lambda: torch.cuda.current_stream(x2.device).wait_stream(side))
        if predicted is not None:    # after the down launch, not before it: the down waits for the shared expert only
            self._prefetch_copy(predicted)
        self.last_expert_ids = ids[:, :k]
        return out

    def _prefetch_next(self, x2: torch.Tensor) -> torch.cuda.Stream | None:
        """`expert_prefetch`: on the device's "predict" stream, forked here, the next MoE layer's router on this
        layer's input names its likely host experts (`expert_prefetch.predict`). The caller joins the returned
        stream after this layer's expert launches (`_prefetch_copy`: the prediction clears the next layer's `ready`
        flags before its router reads them; x2 stays alive until then); None when nothing was launched.
        Its own stream, not the shared expert's: queued there (as in h100-39/40) it ran before the shared expert's
        down GEMV, which this layer's down launch waits for (a suspect for the prefetch's cost at batch 1, not timed
        apart). The next layer's router redirects only within this forward (`Prefetch.armed`)."""
        nxt = None if self._prefetch_to is None else self._prefetch_to[0]
        t = None if nxt is None else nxt.table
        pf = None if t is None else t.prefetch
        if pf is None or not x2.is_cuda or not pf.min_tokens <= x2.shape[0] <= pf.max_tokens:
            return None
        from stage_worker.kernels.common import side_stream
        from stage_worker.kernels.expert_prefetch import predict

        stream = side_stream(x2.device, "predict")
        stream.wait_stream(torch.cuda.current_stream(x2.device))
        with torch.cuda.stream(stream):
            predict(x2, nxt.gate.weight, pf.top, pf, t.hot, slot_map=t.slot_map,
                    valid=self.valid_rows)
        pf.armed = True
        return stream

    def _prefetch_copy(self, predicted: torch.cuda.Stream) -> None:
        """After this layer's expert launches: the forward's stream joins the prediction (`_prefetch_next`), then
        `expert_prefetch`'s copy of the predicted host rows into the next layer's prefetch slots runs on the device's
        "prefetch" stream (joined at the end of the forward, `join_prefetch`), forked from the forward's stream
        there: so the copy's PCIe reads start once this layer's own host reads are done and run beside the next
        layer's token mixer. Started beside this layer's experts instead (h100-39), the copies slowed their host
        reads: batch 1 90.7% of all in VRAM against 94.2% without the prefetch."""
        nxt = self._prefetch_to[0]
        t = nxt.table
        from stage_worker.kernels.common import side_stream
        from stage_worker.kernels.expert_prefetch import copy, note_pending

        device = t.prefetch.slot.device
        main = torch.cuda.current_stream(device)
        main.wait_stream(predicted)
        copier = side_stream(device, "prefetch")
        copier.wait_stream(main)
        with torch.cuda.stream(copier):
            copy(t.prefetch, [t.dev[p] for p in t.parts], [t.host[p] for p in t.parts], t.hot)
        note_pending(device)

    def _routed_decode(self, x2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       add: torch.Tensor | None = None, before_down=None) -> torch.Tensor:
        """The routed experts' decode launches: the INT4 pair, or the bf16 pair in FP8 mode
        (`kernels.moe.fused_moe_fp8`) for float8 experts; with a table (cold experts) the same launches read host
        slots (`host`, `first_host`); `add` summed into the output; `before_down` (INT4 only) called between the
        pair's launches (`fused_moe_int4`)."""
        t = self.table
        if self.fp8_block:
            from stage_worker.kernels.moe import fused_moe_fp8

            if t is None:
                return fused_moe_fp8(x2, ids, weights, self.packed(), add=add)
            dev, host = t.fp8_experts()
            return fused_moe_fp8(x2, ids, weights, dev, add=add, host=host, first_host=t.hot, claim=t.claimed())
        from stage_worker.kernels.moe_int4 import fused_moe_int4

        if t is None:
            return fused_moe_int4(x2, ids, weights, self.packed(), add=add, before_down=before_down)
        dev, host = t.packed_experts()
        return fused_moe_int4(x2, ids, weights, dev, host=host, first_host=t.hot, add=add, claim=t.claimed(),
                              before_down=before_down)

    def _packed_prefill(self, x2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        kernel: bool) -> torch.Tensor:
        """INT4 experts at prefill (and on the CPU): with `kernel`, the grouped tensor-core GEMMs of
        `moe_int4_prefill.py` (four launches with host slots, no host sync, each host slot read over PCIe once a
        chunk); otherwise the per-expert loop (`ExpertTable.moe_int4`, `moe_int4.grouped_moe_int4`). Float8
        experts: the per-expert loop `moe.grouped_moe_fp8` (`ExpertTable.moe_fp8` with a table; their tensor-core
        kernel is not written)."""
        from stage_worker.kernels.moe_int4 import grouped_moe_int4

        t = self.table
        if self.fp8_block:
            from stage_worker.kernels.moe import grouped_moe_fp8

            return grouped_moe_fp8(x2, ids, weights, self.packed()) if t is None else t.moe_fp8(x2, ids, weights)
        if kernel:
            from stage_worker.kernels.moe_int4_prefill import grouped_moe_int4_triton

            if t is None:
                return grouped_moe_int4_triton(x2, ids, weights, self.packed())
            dev, host = t.packed_experts()
            return grouped_moe_int4_triton(x2, ids, weights, dev, host, t.hot)
        return grouped_moe_int4(x2, ids, weights, self.packed()) if t is None else t.moe_int4(x2, ids, weights)

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        E, two_i, H = self.w13.shape
        T = x.shape[0]
        combine = torch.zeros(T, E, dtype=weights.dtype, device=x.device).scatter_add(1, ids, weights)   # [T, E]
        g, u = F.linear(x, self.w13.reshape(E * two_i, H)).view(T, E, two_i).chunk(2, dim=-1)
        h = self.act(g) * u * combine[..., None].to(x.dtype)                                          # [T, E, I]
        return F.linear(h.reshape(T, -1), self.w2.permute(1, 0, 2).reshape(H, -1))

    def prepare_kernels(self) -> None:
        """Lay the shared expert out for the fused MoE kernels, without copying it: the router and shared-gate
        weights become row views of one [E + 1, H] tensor (one GEMV gives both), gate_proj and up_proj row views of
        one [2I, H] tensor (the routed experts' w13 layout). State-dict names and values do not change."""
        se = self.shared_expert
        if self._prefetch_to is not None and self.gate.weight.is_cuda:
            from stage_worker.kernels.common import side_stream

            for name in ("predict", "prefetch"):        # made now, never first inside a graph capture
                side_stream(self.gate.weight.device, name)
        if self.kernels.fused_router and self.gate.weight.is_cuda:
            from stage_worker.kernels.moe import router_lock

            router_lock(self.gate.weight.device)                # made now, never first inside a graph capture
        if self.packed_group or self.fp8_block:
            # the INT4 (and FP8) kernels take no shared-expert slot; a bf16 shared expert gets the bf16 kernel's w13 layout
            if se is not None and all(type(m) is nn.Linear for m in (se.gate_proj, se.up_proj, se.down_proj)) \
                    and self._packed_shared() is None:
                self._shared_w13 = fuse_rows([se.gate_proj, se.up_proj])
            if se is not None and all(isinstance(m, PackedLinear) for m in (se.gate_proj, se.up_proj,
                                                                             se.down_proj)) \
                    and self._packed_shared_int() is None:
                self._shared_gate_up = fuse_packed([se.gate_proj, se.up_proj])
            if se is not None and type(self.gate) is nn.Linear and type(self.shared_expert_gate) is nn.Linear \
                    and self._packed_router() is None:
                self._packed_gates = fuse_rows([self.gate, self.shared_expert_gate])
            if self.kernels.side_stream and self.gate.weight.is_cuda and self._packed_shared_int() is not None:
                from stage_worker.kernels.common import side_stream

                side_stream(self.gate.weight.device)     # made now, never first inside a graph capture
            return
        two_i = (self.w13 if self.table is None else self.table.w13).shape[1]
        if se is None or se.gate_proj.weight.shape[0] != two_i // 2 or self._fused_shared() is not None:
            return
        self._router_and_shared = (fuse_rows([self.gate, self.shared_expert_gate]),
                                   fuse_rows([se.gate_proj, se.up_proj]))

    def _fused_shared(self):
        """(router [E + 1, H], SharedExpert) if `prepare_kernels` laid the weights out and nothing rebound them
        since (a load that assigns new tensors would leave the fused copies stale)."""
        fused = getattr(self, "_router_and_shared", None)
        if fused is None:
            return None
        router, w13 = fused
        se = self.shared_expert
        if not (still_fused(router, [self.gate, self.shared_expert_gate]) and
                still_fused(w13, [se.gate_proj, se.up_proj])):
            self._router_and_shared = None
            return None
        from stage_worker.kernels.moe import SharedExpert

        return router, SharedExpert(w13, se.down_proj.weight)

    def _packed_shared_int(self) -> tuple | None:
        """Beside INT4 experts: a shared expert kept packed (PackedLinear) as (gate and up as one PackedWeight
        [2I, H], down's PackedWeight), if `prepare_kernels` fused gate and up and nothing rebound them."""
        se = self.shared_expert
        fused = getattr(self, "_shared_gate_up", None)
        if se is None or not still_fused_packed(fused, [se.gate_proj, se.up_proj]) or \
                not isinstance(se.down_proj, PackedLinear):
            return None
        return fused, se.down_proj.packed()

    def _packed_router(self) -> torch.Tensor | None:
        """Beside INT4 experts: the router and shared-gate rows as one [E + 1, H] tensor, if `prepare_kernels` laid
        them out and nothing rebound them since (an expert table's `order_gate` does: then None)."""
        fused = getattr(self, "_packed_gates", None)
        return fused if still_fused(fused, [self.gate, self.shared_expert_gate]) else None

    def _packed_shared(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Beside INT4 experts: the shared expert as one-expert tables (w13 [1, 2I, H], w2 [1, H, I]) for
        `kernels.moe.fused_moe`, if `prepare_kernels` laid gate/up out as one tensor and nothing rebound them."""
        se = self.shared_expert
        w13 = getattr(self, "_shared_w13", None)
        if se is None or not still_fused(w13, [se.gate_proj, se.up_proj]):
            return None
        return w13[None], se.down_proj.weight[None]

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
