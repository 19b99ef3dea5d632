"""Which fast kernels the model uses: one switch per kernel family, so each can be measured against its absence.

Read once (from the cluster config, a benchmark's flags, or MOEPIPE_KERNELS) and handed to the model with
`StageModel.set_kernels`; layers never read the environment. Kernels only run on CUDA tensors; on the CPU every
layer takes its PyTorch reference path whatever the flags say, but for `sdpa_prefill`, which also picks PyTorch's
fused attention for a CPU stage's attention (prefill and decode).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# The kernel families, one KernelFlags field each: the config module holds the list (and `kernels_error`, the
# check of a spec), so the launcher and every component refuse a misspelt `kernels` before a stage starts.
from shared.cluster_config import KERNEL_NAMES as NAMES
from shared.cluster_config import kernels_error

# Named only: "all" leaves these off until a GPU has run their GPU tests and timed them faster ("all,l2_prefetch"
# turns one on). pdl left this list after h200-19 (bit for bit, the 48-layer step 4-5% faster); side_stream never
# joined it: timed on an H100 (h100-28, bit for bit, 2-7% faster; h100-29 again: 4.61-4.71 against 4.90 ms at
# batch 1, 7.55 against 8.09-8.13 at 4), not yet on an H200.
NOT_IN_ALL = ("l2_prefetch", "staged_inputs")


@dataclass(frozen=True)
class KernelFlags:
    moe: bool = False                 # router top-k + fused expert GEMVs, shared expert as one more slot (moe.py)
    moe_prefill: bool = False         # prefill experts as two grouped GEMM launches (moe_prefill.py); with `moe`
    moe_int4_prefill: bool = False    # the same for INT4 experts kept packed, host slots read once per chunk
                                      # (moe_int4_prefill.py); with `moe`
    hyper_connection: bool = False    # GatedResidual in three kernels, injection fused in (hyper_connection.py)
    rmsnorm: bool = False             # fused zero-centred / grouped RMSNorm (stage_worker/kernels/rmsnorm.py)
    attention: bool = False           # one q/k/v GEMV, prologue kernel, QSA selection, paged split-K decode
                                      # attention (attention_prep.py, qsa.py, decode_attention.py)
    deltanet: bool = False            # decode: one in-projection GEMV + two fused conv/recurrence/norm kernels
                                      # (deltanet_decode.py); prefill: flash-linear-attention's chunked kernel
    moe_int4_fused: bool = False      # INT4 experts + bf16 shared expert decode in six launches (SparseMoE
                                      # ._packed_decode: router and shared gate one GEMV, shared output added in
                                      # the INT4 down launch) instead of twelve to fifteen; with `moe`
    quant_gemv_fma: bool = False      # packed dense GEMVs (quant_gemv.py) at 2-16 tokens: FMAs per token over each
                                      # decoded period; off: the same kernel with one tl.dot a value position (the
                                      # 8-16-token A/B)
    qsa_tiles: bool = False           # QSA decode selection over tiles of keys in many programs (qsa.py, six
                                      # launches); off: one select program a sequence (slow at long context); with
                                      # `attention`
    section_attention: bool = False   # QSA prefill over host K/V (`qsa_kv_offload`): one fused launch a staged
                                      # context section, the next one gathered on a side stream meanwhile
                                      # (section_attention.py); off: the PyTorch section loop
    quant_gemv_wide: bool = False     # packed dense GEMVs at 4 to WIDE_MAX_T (128) tokens: a program a group of
                                      # 16 tokens, each tile decoded once and fed to one tl.dot (quant_gemv(wide=);
                                      # h200-16: 1.2-6x faster than the FMA kernel at 4-16); off: the FMA kernel's
                                      # token groups / the tl.dot variant up to 16, dequant_matmul past it
    section_union: bool = False       # with `section_attention`: stage only the union of the chunk's selected
                                      # compression blocks, compacted (section_attention.union_plan), so PCIe bytes
                                      # and the kernel's work scale with the union; off: the whole context staged
    sample_race: bool = False         # device sampling's draw (batch_sampler, `device_sampling`): hash, race, argmax
                                      # and validity check in one launch (two for a whole vocabulary at few rows),
                                      # plain temperature rows Gumbel-max over the logits with no softmax
                                      # (sample_race.py; h200-16: served TPOT at 1 stream 3.63 against 4.11 ms);
                                      # off: ~45 PyTorch launches
    pdl: bool = False                 # Hopper's programmatic dependent launch for the decode kernels that take it
                                      # (quant_gemv, hyper_connection's mix, ...; docs/architecture.md lists them):
                                      # each launches while the previous kernel of the stream finishes, loads its
                                      # first weight tile, then waits (griddepcontrol.wait) before anything an
                                      # earlier kernel writes; kernels.common.pdl_usable: CUDA, compute
                                      # capability >= 9, no interpreter (h200-19: tests/test_kernel_pdl.py -m gpu
                                      # bit for bit; 48-layer reports-mixed step back to back 5.32 against 5.58-5.61
                                      # ms at batch 1, 8.70 against 9.07-9.10 at 4); off: plain launches, the
                                      # kernels compiled exactly as before
    quant_dequant: bool = False       # packed dense weights at more tokens than the GEMV kernels take (prefill,
                                      # batches past quant_gemv.WIDE_MAX_T): each block of rows dequantized by one
                                      # Triton launch (quant_dequant.py) before its cuBLAS call; off: PyTorch's
                                      # chain of whole-tensor ops a block (45 launches a 4M-element INT6 block;
                                      # h200-20: four short prompts of the 48-layer reports-mixed model at once
                                      # 1.3-2.4 s to the first token). Process-wide, as pdl
                                      # (quant_gemv.set_dequant_kernel from StageModel.set_kernels)
    l2_prefetch: bool = False         # with `pdl`: before its wait each program of the PDL kernels that stream
                                      # a known weight range (quant_gemv's two kernels, the mix's down and up
                                      # GEMVs) asks the L2 for its whole range (its rows x its K slice, scales
                                      # too; cp.async.bulk.prefetch.L2, common.l2_prefetch_rows), so the weights
                                      # come from HBM while the previous kernel still runs and the loads after
                                      # the wait hit the 50 MB L2; kernels.common.l2_prefetch_usable: the flag
                                      # and pdl_usable. Not in "all" until tests/test_kernel_l2_prefetch.py -m gpu
                                      # has run and it is timed; off (or without pdl): the kernels compiled
                                      # exactly as before (a constexpr L2PF)
    sdpa_prefill: bool = False        # the full-attention layers' prefill (`GatedAttention._attend_heads`, not QSA
                                      # layers on a GPU: slower there) through torch's scaled_dot_product_attention
                                      # with the causal mask (its memory-efficient kernel: no [heads, queries,
                                      # context] scores in HBM). In "all" since h200-26: Qwen3-Next shape, 16
                                      # layers, 16k tokens in 2048 chunks: 0.46 / 0.44 s against 0.51 / 0.52 s.
                                      # On the CPU every attention layer's masked scores (prefill, and a decode
                                      # step's one query: neutral) and QSA's gathered keys (`_attend_selected`):
                                      # 2.3-3x faster a prefill call on one thread; off: the eager scores and
                                      # fp32 softmax
    side_stream: bool = False         # INT4 experts with a packed (INT6) shared expert at decode: the shared
                                      # expert's two GEMVs on a second stream beside the router and the INT4 up
                                      # launch (a parallel branch of the decode graph; kernels.common.side_stream).
                                      # Same bits on or off; in "all" since h100-28 (44-layer reports-mixed, back
                                      # to back: 4.76 against 4.86-4.97 ms at batch 1, 7.61 against 8.17 at 4)
    fused_router: bool = False        # the MoE router's GEMV and its top-k in one launch up to 4 tokens
                                      # (moe.router_route: a program a few router rows, the last to finish
                                      # routes), not a cuBLAS GEMV (no PDL dependent: a gap in the chain) and the
                                      # router kernel. Logits summed in fp32 in another order than cuBLAS's, so
                                      # near-ties may pick differently. In "all" since h200-35 with route_key32
                                      # (48-layer reports-mixed, back to back, two A/Bs: 4.66-4.70 against
                                      # 4.79-4.93 ms at batch 1, 8.02-8.06 against 8.23-8.25 at 4; alone it won
                                      # only at batch 1, 8.29 at 4)
    route_key32: bool = False         # the router's top-k (moe._route_row, both router launches) ranks bf16
                                      # logits by int32 keys (value order in the high half, id in the low) instead
                                      # of int64: the same selection and weights, half the bits in each of its ten
                                      # block-wide max reductions. Process-wide, as pdl. Alone neutral (h200-35:
                                      # 4.86-4.88 against 4.80-4.93 ms at batch 1), with fused_router the pair above
    staged_inputs: bool = False       # not a kernel: a decode graph's integer inputs (positions, KV rows, slots,
                                      # block tables, lengths, padding) packed on the host into pinned memory and
                                      # moved by one copy into one device buffer the graph reads views of
                                      # (stage_worker/graph_inputs.py), not ~15 small copies and fills a step

    @classmethod
    def parse(cls, spec: str) -> "KernelFlags":
        """"all" (every kernel but NOT_IN_ALL), "none", or a comma list of names, each optionally prefixed with '-'
        to turn it off ("all,pdl": all and pdl)."""
        spec = spec.strip()
        if spec in ("", "none", "0", "off"):
            return cls()
        err = kernels_error(spec)
        if err:
            raise ValueError(err)
        base = spec.startswith("all") or spec.startswith("-")
        on = {name: base and name not in NOT_IN_ALL for name in NAMES}
        for part in spec.split(","):
            part = part.strip()
            if part in ("", "all"):
                continue
            name, value = (part[1:], False) if part.startswith("-") else (part, True)
            on[name] = value
        return cls(**on)

    @classmethod
    def from_env(cls, default: str = "all") -> "KernelFlags":
        """MOEPIPE_KERNELS as the config module reads every switch (`cluster_config.env_overrides`), else
        `default`: for the tools that run a model outside a cluster (route-stats)."""
        from shared.cluster_config import env_overrides

        return cls.parse(env_overrides().get("kernels", default))

    def describe(self) -> str:
        on = [f.name for f in fields(self) if getattr(self, f.name)]
        return ",".join(on) if on else "none"


NONE = KernelFlags()
