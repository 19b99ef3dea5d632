"""INT4 expert prefill at the reports' shape: the grouped tensor-core kernels (`moe_int4_prefill.py`) against the
per-expert loop they replace (`ExpertTable.moe_int4`), with a share of the experts in registered host memory.

    python bench/moe_int4_prefill.py [--tokens 44,512,2048] [--shares 0,0.78] [--sweep] [--out FILE.json]
    python bench/moe_int4_prefill.py --tokens 16,26,46,100,200 --shares 0,0.1   # where the decode kernels stop winning

One layer's routed experts (H 2560, I 640, 512 experts top-10, group 128, bf16), random routing (top-k of random
logits: about the spread of random-weight routing, so the present-expert counts are what a dummy-weight server's
chunks see), one chunk of `tokens`. Prints per case: kernel and loop milliseconds, the host experts the chunk reads
(MB) and that over the kernel's time, and the floor a staged design could not beat: one copy-engine copy of the same
bytes (contiguous pinned -> device) plus the kernels on an all-in-VRAM table. `--sweep` times the host launch's
(BLOCK_N, BLOCK_K, warps, stages) candidates, then the device launch's (configs that do not compile or run are
reported and skipped); the winners go by hand into `moe_int4_prefill.CFG`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stage_worker.kernels import moe_int4 as D  # noqa: E402
from stage_worker.kernels import moe_int4_prefill as P  # noqa: E402
from stage_worker.kernels.moe_int4_ref import PackedExperts  # noqa: E402
from stage_worker.model.expert_table import PACKED_PARTS, ExpertTable  # noqa: E402

E, H, I, K, GROUP = 512, 2560, 640, 10, 128
DECODE_CMP_MAX_TK = 2048    # (token, slot) pairs up to which the decode kernels are timed beside the grouped ones


def ms(fn, reps: int, warmup: int = 1) -> float:
    """Median milliseconds of `fn` (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def experts() -> PackedExperts:
    """Random words and scales of the full shape (values do not matter for time; small scales keep it finite)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, device="cuda", generator=g, dtype=torch.int32)

    def scales(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, device="cuda", generator=g) * 0.02).bfloat16()

    return PackedExperts(words(E, 2 * I, H // 8), scales(E, 2 * I, H // GROUP), words(E, H, I // 8),
                         scales(E, H, I // GROUP), GROUP, GROUP)


def table(ex: PackedExperts, hot: int) -> ExpertTable:
    """An expert table of `ex` whose slots [hot, E) are in pinned host memory (slot s holds expert s)."""
    n = ex.q13.shape[0]
    parts = dict(zip(PACKED_PARTS, (ex.q13, ex.s13, ex.q2, ex.s2)))
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    return ExpertTable(dev={p: t[:hot].contiguous() for p, t in parts.items()},
                       host={p: t[hot:].cpu().pin_memory() for p, t in parts.items()},
                       expert_of_slot=torch.arange(n, dtype=torch.int32, device="cuda"),
                       counts=torch.zeros(n, device="cuda"), host_reads=zero, moves=zero.clone(),
                       initial=tuple(range(n)), groups=(ex.group, ex.down_group), fp4=ex.fp4)


def case(ex: PackedExperts, tokens: int, share: float, reps: int) -> dict:
    hot = E - round(E * share)
    t = table(ex, hot)
    dev, host = t.packed_experts()
    host = host if hot < E else None
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(tokens, E, device="cuda", generator=g).topk(K, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(tokens, K, device="cuda", generator=g), dim=-1).bfloat16()
    kernel = ms(lambda: P.grouped_moe_int4_triton(x, ids, w, dev, host, hot), reps)
    loop = ms(lambda: t.moe_int4(x, ids, w), max(2, reps // 3))
    decode = None
    if tokens * K <= DECODE_CMP_MAX_TK:
        # The decode kernels (a program per (token, slot): each pair re-reads its expert's rows) at this many
        # tokens, their limit DECODE_MAX_TK lifted: where they beat the grouped kernels, a short prompt's prefill
        # should take them (SparseMoE sends T * k <= moe_int4.DECODE_MAX_TK there).
        old = D.DECODE_MAX_TK
        D.DECODE_MAX_TK = max(old, tokens * K)
        try:
            decode = ms(lambda: D.fused_moe_int4(x, ids, w, dev, host, hot if host is not None else None), reps)
        finally:
            D.DECODE_MAX_TK = old
    present = torch.unique(ids)
    n_host = int((present >= hot).sum())
    host_mb = n_host * ex.nbytes_per_expert() / 1e6
    row = {"tokens": tokens, "host_share": share, "present": int(present.numel()), "host_present": n_host,
           "kernel_ms": kernel, "loop_ms": loop, "decode_kernels_ms": decode, "host_mb": host_mb,
           "host_gbps_over_kernel": host_mb / kernel if n_host else None}
    if n_host:   # the staged floor: one contiguous copy of the same bytes, then the kernels on device rows only
        src = torch.empty(int(host_mb * 1e6), dtype=torch.uint8).pin_memory()
        dst = torch.empty_like(src, device="cuda")
        row["copy_ms"] = ms(lambda: dst.copy_(src, non_blocking=True), reps)
        row["all_vram_kernel_ms"] = ms(lambda: P.grouped_moe_int4_triton(x, ids, w, ex), reps)
        row["staged_floor_ms"] = row["copy_ms"] + row["all_vram_kernel_ms"]
    return row


def sweep(ex: PackedExperts, tokens: int, reps: int, out: list, save) -> None:
    """Host-launch candidates on a table with 78% host slots, then device-launch candidates all in VRAM; each
    result appended to `out`, then `save()`."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(tokens, E, device="cuda", generator=g).topk(K, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(tokens, K, device="cuda", generator=g), dim=-1).bfloat16()
    t = table(ex, E - round(E * 0.78))
    dev, host = t.packed_experts()
    base = dict(P.CFG)
    for kind, cands, args in (("host", [(32, 128, 8, 3), (64, 64, 8, 3), (64, 128, 8, 2), (32, 256, 8, 2)],
                               (dev, host, t.hot)),
                              ("dev", [(64, 64, 8, 3), (64, 128, 8, 2), (128, 64, 8, 3), (32, 128, 8, 3)],
                               (ex, None, None))):
        for cfg in cands:
            P.CFG.update({(kind, "up"): cfg, (kind, "down"): cfg})
            try:
                r = {"kind": kind, "cfg": cfg, "ms": ms(lambda: P.grouped_moe_int4_triton(x, ids, w, *args), reps)}
            except Exception as exc:                       # out of shared memory, registers: skip
                r = {"kind": kind, "cfg": cfg, "error": repr(exc)[:200]}
            print(r, flush=True)
            out.append(r)
            save()
        P.CFG.clear()
        P.CFG.update(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="44,512,2048")
    ap.add_argument("--shares", default="0,0.78")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ex = experts()
    result = {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
              "cfg": {str(k): v for k, v in P.CFG.items()}, "rows": [], "sweep": []}

    def save() -> None:            # after every measurement: a run cut short by its timeout keeps what it has
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    print(f"{'tokens':>6} {'host':>5} {'present':>7} {'host MB':>8} {'kernel ms':>9} {'loop ms':>8} {'x':>6} "
          f"{'GB/s':>6} {'staged floor ms':>15} {'decode kernels ms':>17}")
    for tokens in (int(v) for v in args.tokens.split(",")):
        for share in (float(v) for v in args.shares.split(",")):
            r = case(ex, tokens, share, args.reps)
            result["rows"].append(r)
            save()
            gbps = f"{r['host_gbps_over_kernel']:.1f}" if r["host_gbps_over_kernel"] else "-"
            floor = f"{r['staged_floor_ms']:.2f}" if "staged_floor_ms" in r else "-"
            dec = f"{r['decode_kernels_ms']:.3f}" if r["decode_kernels_ms"] is not None else "-"
            print(f"{tokens:>6} {share:>5.0%} {r['present']:>7} {r['host_mb']:>8.0f} {r['kernel_ms']:>9.2f} "
                  f"{r['loop_ms']:>8.2f} {r['loop_ms'] / r['kernel_ms']:>6.1f} {gbps:>6} {floor:>15} {dec:>17}",
                  flush=True)
    if args.sweep:
        sweep(ex, 512, args.reps, result["sweep"], save)

if __name__ == "__main__":
    main()
