"""KV block geometry derived from the model: the block size, what one block costs on a stage, how many blocks fit.

Why one module: the gateway (which places blocks), every stage (which allocates them), `moepipe generate` and the
local backend must agree on these numbers, and any checkpoint transformers accepts (a QSA compression ratio of 3, say)
must be served without the user choosing a block size by hand.

What constrains the block size: QSA pools every `indexer_compress_ratio` keys into one pooled key stored at
`row // ratio`, so a compression block must never straddle two KV blocks (block_size % ratio == 0). Nothing else
does: the Triton kernels (`qsa.py`, `attention_prep.py` `_pool_kernel`, `decode_attention.py`) take the block size
as the constexpr PAGE but use it only in `//` and `%` (never in `tl.arange`), and pad the ratio to a power of two
with a mask where they range over it, so any multiple of the ratio works on every path.
"""

from __future__ import annotations

import math

from shared.model_config import HybridMoeConfig, Qwen4ExpConfig

__all__ = ["DEFAULT_BLOCK_TOKENS", "DEFAULT_KV_GIB", "KvLayoutError", "auto_num_blocks", "block_bytes",
           "block_multiple", "check_block_size", "compute_dtype", "default_kv_budget", "derived_block_size",
           "host_block_bytes", "host_row_bytes", "qsa_layer_count", "resolve_block_size", "stage_block_cost"]

DEFAULT_BLOCK_TOKENS = 16        # vLLM's default; what the kernels' launch parameters were tuned with
DEFAULT_KV_GIB = 4.0             # the automatic pool's budget per stage when kv_cache_memory is not set
GIB = 1 << 30
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class KvLayoutError(ValueError):
    """A block size or KV budget the model cannot be served with; the message names the key and what would work."""


def block_multiple(cfg: HybridMoeConfig) -> int:
    """What every block size must be a multiple of: the QSA compression ratio (1 without QSA)."""
    if isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa:
        return cfg.indexer_compress_ratio
    return 1


def derived_block_size(cfg: HybridMoeConfig) -> int:
    """lcm(16, ratio): 16 tokens where the model allows it, else the nearest size that is also a whole number of
    compression blocks (48 for ratio 3, 80 for ratio 5)."""
    return math.lcm(DEFAULT_BLOCK_TOKENS, block_multiple(cfg))


def check_block_size(cfg: HybridMoeConfig, block_size: int, key: str = "block_size") -> None:
    """Raise KvLayoutError naming `key` if `block_size` cannot hold whole compression blocks."""
    m = block_multiple(cfg)
    if block_size >= 1 and block_size % m == 0:
        return
    d = derived_block_size(cfg)
    if m == 1:
        raise KvLayoutError(f"{key} {block_size} must be >= 1: use {d}, or leave it unset ({d})")
    raise KvLayoutError(f"{key} {block_size} must be a multiple of indexer_compress_ratio {m} (a QSA compression "
                        f"block cannot straddle two KV blocks): use {d}, {2 * d}, {4 * d} or any multiple of {m}, "
                        f"or leave it unset ({d}, derived from the model)")


def resolve_block_size(cfg: HybridMoeConfig, requested: int | None, key: str = "block_size") -> int:
    """The block size to use: `requested` if it works (an error naming `key` if not), the derived one for 0/None."""
    if not requested:
        return derived_block_size(cfg)
    check_block_size(cfg, requested, key)
    return requested


def compute_dtype(cfg: HybridMoeConfig, device: str, override: str = "") -> str:
    """The dtype a stage computes (and caches) in: `override`, else the checkpoint's, except float32 for half
    precision on a CPU (most CPUs have no bf16/fp16 matrix units: the demo model ran 4.5-6x slower in bf16)."""
    if override:
        return override
    if device.split(":")[0] == "cpu" and cfg.dtype in ("bfloat16", "float16"):
        return "float32"
    return cfg.dtype


def qsa_layer_count(cfg: HybridMoeConfig, start: int, end: int) -> int:
    """Attention layers of [start, end) with a QSA indexer (every attention layer of a model with QSA)."""
    if block_multiple(cfg) == 1:
        return 0
    return sum(1 for layer in range(start, end) if cfg.is_attention(layer))


def host_row_bytes(cfg: HybridMoeConfig, dtype: str) -> int:
    """What `qsa_kv_offload` keeps in host RAM per token of one QSA layer: the K and V rows and the raw indexer key
    (read only when its compression block is pooled; docs/model.md section 11)."""
    return (2 * cfg.num_key_value_heads * cfg.head_dim + cfg.indexer_head_dim) * _ITEMSIZE[dtype]


def block_bytes(cfg: HybridMoeConfig, start: int, end: int, block_size: int, dtype: str,
                kv_offload: bool = False) -> int:
    """Device bytes one KV block costs on a stage holding layers [start, end): per attention layer K and V rows, and
    with QSA the indexer's raw keys and one pooled key per compression block (as `stage_worker.model.cache`
    allocates). With `kv_offload` a QSA layer keeps only its pooled keys on the device (`host_block_bytes` has
    the rest): 1/37 of the bytes at the full shape (64 of 2,368 bytes a token and layer)."""
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim
    layers = sum(1 for layer in range(start, end) if cfg.is_attention(layer))
    qsa = qsa_layer_count(cfg, start, end)
    total = (layers - qsa) * block_size * per_token * _ITEMSIZE[dtype]
    if qsa:
        pooled = block_size // cfg.indexer_compress_ratio * cfg.indexer_head_dim * _ITEMSIZE[dtype]
        body = 0 if kv_offload else block_size * host_row_bytes(cfg, dtype)
        total += qsa * (pooled + body)
    return total


def host_block_bytes(cfg: HybridMoeConfig, start: int, end: int, block_size: int, dtype: str,
                     kv_offload: bool) -> int:
    """Host bytes one KV block costs with `kv_offload` (0 without): the QSA layers' K/V and raw indexer keys."""
    layers = qsa_layer_count(cfg, start, end) if kv_offload else 0
    return layers * block_size * host_row_bytes(cfg, dtype) if layers else 0


def stage_block_cost(cfg: HybridMoeConfig, start: int, end: int, block_size: int, dtype: str, device: str,
                     kv_offload: bool) -> int:
    """What one block costs against a stage's KV budget: its device bytes on a GPU (host K/V is planned against
    host RAM, `shared/memory_plan.py`), every byte on a CPU, where both tiers are the same RAM."""
    dev = block_bytes(cfg, start, end, block_size, dtype, kv_offload)
    if device.split(":")[0] == "cuda":
        return dev
    return dev + host_block_bytes(cfg, start, end, block_size, dtype, kv_offload)


def default_kv_budget(costs: list[int], block_size: int, max_model_len: int, on_gpu: bool) -> float:
    """The budget (GiB per stage) when the user set none: DEFAULT_KV_GIB, and on a GPU at least what one
    `max_model_len` sequence needs, so a long-context checkpoint (262,144 tokens: ~6-7 GiB a stage for the
    reports' model and Qwen3-Next-80B) is not refused by default on a card with room for it. `moepipe serve` then
    replaces this estimate for GPU stages with the memory plan's count (shared/memory_plan.py: free memory,
    `--gpu-memory-utilization`, `--vram-limit`). On the CPU the 4 GiB cap stays: host RAM is shared with
    everything else."""
    if not on_gpu:
        return DEFAULT_KV_GIB
    per_seq = -(-max_model_len // block_size)
    return max(DEFAULT_KV_GIB, (per_seq + 1) * max(costs, default=0) / GIB)


def auto_num_blocks(costs: list[int], block_size: int, max_model_len: int, max_num_seqs: int,
                    budget_gib: float) -> int:
    """Blocks for `max_num_seqs` sequences of `max_model_len`, capped so that every stage (`costs`: bytes per block
    of each stage) stays within `budget_gib`; KvLayoutError if not even one such sequence fits. Each stage also
    holds one scratch block (CUDA-graph padding), counted here."""
    per_seq = -(-max_model_len // block_size)
    want = per_seq * max_num_seqs
    worst = max(costs, default=0)
    if worst == 0:
        return want
    fit = int(budget_gib * GIB) // worst - 1
    if fit < per_seq:
        stage = costs.index(worst)
        raise KvLayoutError(
            f"kv_cache_memory {budget_gib:g} GiB holds {max(fit, 0)} KV blocks of {block_size} tokens on stage "
            f"{stage} ({worst} bytes each); one sequence of max_model_len {max_model_len} needs {per_seq} "
            f"({(per_seq + 1) * worst / GIB:.2f} GiB): raise kv_cache_memory (MOEPIPE_KV_CACHE_MEMORY, "
            f"--kv-cache-memory), lower max_model_len, use more stages, or set num_blocks")
    return min(want, fit)
