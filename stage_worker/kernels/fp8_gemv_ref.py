"""PyTorch reference for `fp8_gemv.py`: a dense Linear weight as a block-FP8 checkpoint (transformers' `fp8`)
stores it, dequantized, then matmul.

Layout (`Fp8Weight`): `q` the float8_e4m3fn bytes [N, K] held as uint8 (as the FP8 experts hold theirs,
`moe_ref.Fp8Experts`), `scale` float32 [ceil(N / br), ceil(K / bc)] (the checkpoint's `weight_scale_inv`: the
weight is q times its block's scale), block (br, bc), 128 x 128 in the checkpoints people publish; edge blocks are
cut where N or K is not a multiple. The dequantization is `moe_ref.dequantize_fp8_block`, the same float32
products the loader's dequantize-at-load path gives (`quant_weight.dequantize_float`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker.kernels.moe_ref import dequantize_fp8_block

CHUNK = 1 << 22          # weight elements dequantized at a time (a large lm_head never held in float at once)


@dataclass
class Fp8Weight:
    q: torch.Tensor                # uint8 [N, K], float8_e4m3fn bytes
    scale: torch.Tensor            # float32 [ceil(N / br), ceil(K / bc)]
    block: tuple[int, int]         # (br, bc): rows, columns a scale covers

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


def dequantize_rows(fw: Fp8Weight, dtype: torch.dtype = torch.float32, start: int = 0,
                    end: int | None = None) -> torch.Tensor:
    """Rows [start, end) of the float weight in `dtype` (float32 products, then `dtype`, as the loader holds a
    dequantized weight); `start` a multiple of the block's rows."""
    br = fw.block[0]
    end = fw.out_features if end is None else end
    if start % br:
        raise ValueError(f"rows from {start}: not a multiple of the block's {br}")
    scale = fw.scale[start // br: -(-end // br)]
    return dequantize_fp8_block(fw.q[start:end], scale, fw.block).to(dtype)


def fp8_gemv_ref(x: torch.Tensor, fw: Fp8Weight) -> torch.Tensor:
    """x [T, K] -> x @ W^T [T, N] in x.dtype, W dequantized in float32, the product in float32."""
    return (x.float() @ dequantize_rows(fw).t()).to(x.dtype)

