"""`startup_warmup` (stage_worker/warmup.py): a GPU stage runs its prefill path and the sampler once before its
first heartbeat, on the scratch slot and KV block. On the CPU (where the stage skips it: nothing compiles) the
same function must leave every request's state as it was: a sequence decodes the same logits with or without a
warm-up between its prefill and its next step, on the first stage, a middle one and the last."""

from __future__ import annotations

import pytest
import torch

from shared.model_config import load_config
from stage_worker import warmup
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec

BS, SLOTS, BLOCKS = 16, 2, 6          # scratch: slot SLOTS, block BLOCKS (the cache has one more of each)


def _run(models, warm: bool, calls: list, device: str = "cpu") -> torch.Tensor:
    dtype = next(models[0].parameters()).dtype
    caches = [m.new_cache(CacheSpec(num_blocks=BLOCKS + 1, block_size=BS, num_slots=SLOTS + 1, dtype=dtype,
                                    device=device)) for m in models]
    prompt = list(range(20, 43))

    def step(tokens, ctx):
        batch = StepBatch.build([(tokens, ctx, 0, [0, 1])], BS, device)
        hidden = None
        for m, c in zip(models, caches):
            hidden = m(batch, c, hidden)
        return models[-1].logits(hidden, batch)

    step(prompt, 0)
    if warm:
        for m, c in zip(models, caches):
            calls.append(warmup.warm_up(m, c, block_size=BS, scratch_slot=SLOTS, scratch_block=BLOCKS,
                                        race_kernel=False))
    return torch.cat([step([7], len(prompt)), step([9], len(prompt) + 1)])


@pytest.mark.parametrize("split", [None, 3])
def test_a_warm_up_leaves_every_request_state_alone(tiny_checkpoint, split, monkeypatch):
    cfg = load_config(tiny_checkpoint)
    n = cfg.num_hidden_layers
    ranges = [(0, n)] if split is None else [(0, split), (split, n)]
    models = [load_model(tiny_checkpoint, LoadOptions(load_format="dummy", dtype=torch.float32, start=s, end=e), cfg)
              for s, e in ranges]
    sampled = []
    real = warmup.sample_rows
    monkeypatch.setattr(warmup, "sample_rows", lambda *a, **kw: sampled.append(len(a[1])) or real(*a, **kw))
    calls: list[float] = []
    want = _run(models, False, calls)
    got = _run(models, True, calls)
    assert len(calls) == len(models) and all(s > 0 for s in calls)
    # the last stage sampled after each of its two prefill lengths, at each decode batch size (default 1 and 4;
    # the server passes its graphs' sizes): the four kinds of row mixed, then each kind alone
    assert sampled == ([1] * 5 + [4] * 5) * 2
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_warm_up_runs_the_gpu_paths_and_leaves_state_alone(tiny_checkpoint):
    """On the GPU with every kernel on: the warm-up's one-prompt and two-prompt (ragged: flash-linear-attention's
    varlen kernels, two prompts on the one scratch slot) steps run without error, and a request decodes as it
    would without them."""
    from stage_worker.kernels.flags import KernelFlags

    cfg = load_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, LoadOptions(load_format="dummy", dtype=torch.bfloat16, device="cuda"), cfg)
    model.set_kernels(KernelFlags.parse("all"))
    calls: list[float] = []
    want = _run([model], False, calls, "cuda")
    got = _run([model], True, calls, "cuda")
    assert len(calls) == 1 and calls[0] > 0
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-3)   # (a touched state: far more)
