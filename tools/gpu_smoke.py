"""GPU smoke check: the PyTorch path on CUDA agrees with the CPU path (tiny preset, bf16 and fp32), and prints how
long prefill and decode steps take. Run on the GPU machine: python tools/gpu_smoke.py MODEL_DIR"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402


def run(model_dir: str, device: str, dtype: torch.dtype, ids: list[int], steps: int,
        forced: list[int] | None = None):
    model = load_model(model_dir, LoadOptions(device=device, dtype=dtype))
    eng = LocalEngine([model])
    eng.add(0)
    out = [eng.step([(0, ids)])[0].cpu()]
    times = []
    tok = int(out[0].argmax()) if forced is None else forced[0]
    fed = [tok]
    for i in range(steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = eng.step([(0, [tok])])[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        out.append(logits.cpu())
        tok = int(logits.argmax()) if forced is None else forced[min(i + 1, len(forced) - 1)]
        fed.append(tok)
    return torch.stack(out), times, fed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", help="a checkpoint directory (e.g. `moepipe make-model --preset tiny --out DIR`)")
    model_dir = ap.parse_args().model_dir
    ids = list(range(10, 90))
    ref, _, fed = run(model_dir, "cpu", torch.float32, ids, 16)
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 0.15)):
        got, times, _ = run(model_dir, "cuda", dtype, ids, 16, forced=fed)
        err = (got - ref).abs().max().item()
        times.sort()
        print(f"cuda {dtype}: max |logit diff| vs CPU fp32 = {err:.2e} (tol {tol}); decode step median "
              f"{1e3 * times[len(times) // 2]:.1f} ms")
        assert err < tol, "CUDA path disagrees with the CPU path"
    return 0


if __name__ == "__main__":
    sys.exit(main())
