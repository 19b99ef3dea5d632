"""Train the built-in demo model: a small Qwen4-Exp with every extension on, on the offline corpus (issue 6).

    python tools/build_corpus.py                                   # once, on a machine with the source texts
    python tools/train_demo.py --corpus .corpus --out runs/demo --minutes 9.5       # resumes if runs/demo exists
    python tools/train_demo.py --corpus .corpus --out runs/demo --eval --export shared/demo_model
    python tools/train_demo.py --corpus .corpus --out runs/demo --prepare    # tokenizer + token cache only (for a
                                                                             # GPU machine: tools/train_device.sh)

The model is the project's own `StageModel` in a training mode of the same modules (no second model): the
reference (PyTorch) paths run with autograd (on a GPU too: the model's own chunked delta rule carries the
gradients), same-length windows go through each layer as one batch (`StepBatch.ragged`), the MoE runs every
expert densely (`SparseMoE.dense_experts`), and the modules' training hooks add
* a load-balancing loss per MoE layer (`SparseMoE.aux`), so the router spreads its choices without collapsing;
* the QSA indexer's distillation toward dense attention (`GatedAttention.aux`): for the first `--distill-steps`
  steps every query attends densely (`qsa_dense`) while the indexer learns which blocks attention uses, then the
  model trains with the indexer's sparse selection (and the indexer keeps distilling);
* the MTP head's loss on token t+2.
The PLE n-gram table is trained as an embedding of its hashed rows.

Reproducible: the batch of step s depends only on (seed, s), the initialisation only on the seed, so a rerun gives
the same losses (bit-identical on the CPU; within GPU reduction-order noise on CUDA) and a resumed run continues
exactly where the checkpoint left off. Every run stops itself after `--minutes`, saving a checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shared.model_config import config_from_dict  # noqa: E402
from stage_worker.checkpoint.make_model import export_checkpoint, preset_config  # noqa: E402
from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files  # noqa: E402
from stage_worker.kernels.flags import KernelFlags  # noqa: E402
from stage_worker.model.attention import GatedAttention  # noqa: E402
from stage_worker.model.batch import StepBatch  # noqa: E402
from stage_worker.model.cache import CacheSpec  # noqa: E402
from stage_worker.model.model import StageModel  # noqa: E402
from stage_worker.model.moe import SparseMoE  # noqa: E402

LOSS_WEIGHTS = {"moe_balance": 0.01, "indexer_kl": 0.1, "mtp": 0.3}
TOKENIZER_TEXT_MB = 24          # training text the BPE sees (mixed over kinds)


class TrainableTable(nn.Module):
    """The PLE n-gram table as a trainable embedding: `gather(rows)` is what `PLEBranch` calls on any table."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        nn.init.normal_(self.weight, 0.0, 0.02)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return F.embedding(rows.to(self.weight.device), self.weight)


# ---- data ---------------------------------------------------------------------------------------------------

def load_documents(corpus: Path) -> list[tuple[str, str, str, bool]]:
    from build_corpus import iter_documents   # tools/ is on sys.path when run as a script

    return list(iter_documents(corpus))


def build_tokenizer(out: Path, docs, vocab_size: int, max_len: int):
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        tok_dir.mkdir(parents=True, exist_ok=True)
        docs = docs()
        budget = TOKENIZER_TEXT_MB << 20
        kinds = sorted({k for k, _, _, _ in docs})
        per_kind = budget // len(kinds)

        def texts():
            for kind in kinds:
                left = per_kind
                for k, _, text, held in docs:
                    if k == kind and not held and left > 0:
                        left -= len(text.encode("utf-8"))
                        yield text
        write_tokenizer_files(tok_dir, vocab_size=vocab_size, model_max_length=max_len, texts=texts())
    from shared.tokenizer import Tokenizer

    return Tokenizer.from_dir(tok_dir), tok_dir


def tokenize(out: Path, tok, docs, eos: int) -> dict[str, dict[str, np.ndarray]]:
    """{split: {kind: int32 token stream}} (documents joined by EOS), cached in out/tokens.npz (uint16,
    compressed: the cache and the tokenizer are all a GPU machine needs, about 20 MB instead of the corpus)."""
    cache = out / "tokens.npz"
    if cache.exists():
        data = np.load(cache)
        streams: dict[str, dict[str, np.ndarray]] = {"train": {}, "heldout": {}}
        for key in data.files:
            split, kind = key.split(":", 1)
            streams[split][kind] = data[key].astype(np.int32)
        return streams
    streams = {"train": {}, "heldout": {}}
    docs = docs()
    for kind in sorted({k for k, _, _, _ in docs}):
        for split, held in (("train", False), ("heldout", True)):
            ids: list[int] = []
            for k, _, text, h in docs:
                if k == kind and h == held:
                    ids.extend(tok.encode(text))
                    ids.append(eos)
            streams[split][kind] = np.asarray(ids, dtype=np.int32)
    save_tokens(out, streams)
    return streams


def save_tokens(out: Path, streams: dict[str, dict[str, np.ndarray]]) -> None:
    assert all(int(v.max(initial=0)) < 1 << 16 for d in streams.values() for v in d.values())
    np.savez_compressed(out / "tokens.npz",
                        **{f"{s}:{k}": v.astype(np.uint16) for s, d in streams.items() for k, v in d.items()})


def batch_for_step(streams: dict[str, np.ndarray], step: int, seed: int, batch: int, seq: int,
                   chat_share: float = 0.0) -> torch.Tensor:
    """[batch, seq + 2] token windows, corpus kinds equally likely (a window is chat text with probability
    `chat_share`): a function of (seed, step) only."""
    rng = np.random.default_rng([seed, step])
    kinds = sorted(k for k in streams if k != "chat")
    rows = []
    for _ in range(batch):
        if chat_share > 0 and rng.random() < chat_share:
            s = streams["chat"]
        else:
            s = streams[kinds[rng.integers(len(kinds))]]
        start = int(rng.integers(0, len(s) - seq - 2))
        rows.append(s[start:start + seq + 2])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# ---- model --------------------------------------------------------------------------------------------------

def build_model(cfg, seed: int, device: str) -> StageModel:
    torch.manual_seed(seed)
    model = StageModel(cfg, with_mtp=True)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers) if name.endswith(("o_proj.weight", "out_proj.weight",
                                                                                 "down_proj.weight", ".w2")) else 0.02
            nn.init.normal_(p, 0.0, std)
    for layer in model.layers.values():
        if layer.ple is not None:
            layer.ple.table = TrainableTable(layer.ple.spec.padded_rows, cfg.ple_head_dim)   # registered: trained
    if model.mtp is not None and model.has_embedding:
        # On disk the MTP head reads the model's embedding (transformers' layout has no copy of its own); a separate
        # trainable copy here would train an embedding the export then drops.
        model.mtp.embed_tokens.weight = model.embed_tokens.weight
    return model.to(device)


def set_phase(model: StageModel, aux: list | None, dense: bool, distill: bool = True) -> None:
    """Training hooks: MoE dense with its balance loss into `aux` (None: as served); attention dense (`dense`) or
    with the indexer's selection, and the indexer's distillation loss into `aux` unless `distill` is off (agent
    sequences: dense scores over a 25k-token context would not fit, and attention then runs as served, reading
    only the selected keys past 2k tokens)."""
    for m in model.modules():
        if isinstance(m, SparseMoE):
            m.aux = aux
            m.dense_experts = aux is not None
        if isinstance(m, GatedAttention):
            m.aux = aux if m.indexer is not None and distill else None
            m.qsa_dense = dense


def forward_losses(model: StageModel, tokens: torch.Tensor, block_size: int = 16) -> dict[str, torch.Tensor]:
    """Next-token CE, MTP CE (t+2) and the modules' auxiliary losses for a [B, L + 2] window batch."""
    B, L = tokens.shape[0], tokens.shape[1] - 2
    dev = next(model.parameters()).device
    blocks = -(-L // block_size)
    seqs = [(tokens[i, :L].tolist(), 0, i, list(range(i * blocks, (i + 1) * blocks))) for i in range(B)]
    batch = StepBatch.build(seqs, block_size, dev, all_logits=True)
    cache = model.new_cache(CacheSpec(num_blocks=B * blocks, block_size=block_size, num_slots=B,
                                      dtype=torch.float32, device=dev))
    aux: list = []
    set_phase(model, aux, dense=getattr(model, "_dense_phase", False))
    hidden = model(batch, cache)
    final = model.final_hidden(hidden)
    targets = tokens[:, 1:L + 1].reshape(-1).to(dev)
    ce = F.cross_entropy(model.lm_head(final).float(), targets)
    # MTP: from the final hidden state at t and the embedding of t+1, predict t+2.
    mseqs = [(tokens[i, 1:L + 1].tolist(), 0, i, list(range(i * blocks, (i + 1) * blocks))) for i in range(B)]
    mbatch = StepBatch.build(mseqs, block_size, dev, all_logits=True)
    mtp_hidden = model.mtp(final, mbatch, cache)
    mtp = F.cross_entropy(model.lm_head(mtp_hidden).float(), tokens[:, 2:L + 2].reshape(-1).to(dev))
    set_phase(model, None, dense=False)
    out = {"ce": ce, "mtp": mtp}
    for kind in ("moe_balance", "indexer_kl"):
        vals = [v for k, v in aux if k == kind]
        out[kind] = torch.stack(vals).mean() if vals else ce.new_zeros(())
    return out


def agent_losses(model: StageModel, group, fresh: list[list], block_size: int = 16) -> dict[str, torch.Tensor]:
    """Cross-entropy over the replies only (`tools/agent_data.py`), for a group of examples sharing a long prefix
    and for batches of independent (`fresh`) examples. The group's prefix runs once, without gradients, into slot 0; its
    recurrent states are copied to each example's slot and its K/V blocks are shared through the block tables, so
    each example feeds only its tail, with gradients, as a continuing sequence (what chunked prefill serves). The
    examples of a fresh batch are right-padded to one length (the model is causal: padding after a sequence changes
    nothing before it) so each batch runs as one [B, L] step instead of a loop over sequences."""
    dev = next(model.parameters()).device
    bs = block_size
    prefix = group.prefix if group is not None else []
    examples = group.examples if group is not None else []
    P = len(prefix)
    shared = list(range(P // bs))
    parts, targets = [], []
    nblocks, slot = len(shared), 1
    pad = model.cfg.pad_token_id or 0
    for batch_examples, ctx in [(examples, P)] + [(b, 0) for b in fresh]:
        width = max((len(e.ids) for e in batch_examples), default=0)
        seqs = []
        for e in batch_examples:
            ids = e.ids + [pad] * (width - len(e.ids) if ctx == 0 else 0)
            own = -(-len(ids) // bs) - ctx // bs
            table = (shared if ctx else []) + list(range(nblocks, nblocks + own))
            nblocks += own
            seqs.append((ids[ctx:], ctx, slot, table))
            slot += 1
            targets.extend(e.ids[p + 1] if e.reply_start <= p + 1 < len(e.ids) else -100
                           for p in range(ctx, len(ids)))
        parts.append(seqs)
    cache = model.new_cache(CacheSpec(num_blocks=nblocks, block_size=bs, num_slots=slot, dtype=torch.float32,
                                      device=dev))
    if P:
        with torch.no_grad():
            set_phase(model, None, dense=False)
            model(StepBatch.build([(prefix, 0, 0, shared)], bs, dev), cache)
            n = len(examples)
            for state in list(cache.deltanet.values()) + list(cache.ple.values()):
                for t in vars(state).values():
                    t[1:n + 1] = t[0]
    aux: list = []
    set_phase(model, aux, dense=False, distill=False)
    hidden = []
    for part in parts:                  # the group's continuing tails, then each fresh batch
        if part:
            hidden.append(model.final_hidden(model(StepBatch.build(part, bs, dev, all_logits=True), cache)))
    set_phase(model, None, dense=False)
    logits = model.lm_head(torch.cat(hidden)).float()
    ce = F.cross_entropy(logits, torch.tensor(targets, device=dev), ignore_index=-100)
    balance = torch.stack([v for k, v in aux if k == "moe_balance"]).mean() if aux else ce.new_zeros(())
    return {"agent_ce": ce, "agent_moe_balance": balance}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# ---- evaluation ---------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: StageModel, streams: dict[str, dict[str, np.ndarray]], tok, seq: int,
             max_tokens: int) -> dict[str, dict[str, float]]:
    """Bits per byte on held-out text of each kind: the model, and a unigram over the training tokens (add-one
    smoothed), both over the same predicted tokens and divided by the UTF-8 bytes those tokens decode to."""
    model.eval()
    out = {}
    for kind, held in sorted(streams["heldout"].items()):
        held = held[: max_tokens + 2]
        counts = np.bincount(streams["train"][kind], minlength=model.cfg.vocab_size).astype(np.float64) + 1.0
        logp_uni = np.log2(counts / counts.sum())
        bits = 0.0
        n_tokens = 0
        for start in range(0, len(held) - seq - 2, seq):
            window = torch.from_numpy(held[start:start + seq + 2].astype(np.int64))[None]
            losses = forward_losses(model, window)
            bits += losses["ce"].item() * seq / math.log(2)
            n_tokens += seq
        if n_tokens == 0:
            continue
        predicted = held[1:n_tokens + 1]
        uni_bits = -logp_uni[predicted].sum()
        bytes_covered = len(tok.decode([int(i) for i in predicted], False).encode("utf-8"))
        out[kind] = {"tokens": n_tokens, "bytes": bytes_covered, "model_bpb": bits / bytes_covered,
                     "unigram_bpb": uni_bits / bytes_covered}
        out[kind]["ratio"] = out[kind]["model_bpb"] / out[kind]["unigram_bpb"]
    model.train()
    return out


# ---- main ---------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=".corpus")
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--total-steps", type=int, default=4000, help="length of the LR schedule")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this step (tests, reruns)")
    ap.add_argument("--distill-steps", type=int, default=300, help="dense-attention steps that warm up the indexer")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--minutes", type=float, default=9.5, help="stop and save after this long (a run fits 10 min)")
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--train-only", default=None, metavar="PREFIX",
                    help="train only parameters whose name starts with PREFIX (e.g. 'mtp.': re-fit the MTP head of "
                         "an export without touching the model it reads)")
    ap.add_argument("--chat-share", type=float, default=0.0,
                    help="share of training windows taken from chat-formatted conversations made from the corpus "
                         "(tools/chat_data.py); 0 = none, the shipped model's setting")
    ap.add_argument("--agent-batch", type=int, default=0,
                    help="qwen-code-shaped examples per step (tools/agent_data.py: one 25k-token prompt prefix run "
                         "without gradients, the examples' replies trained); 0 = none")
    ap.add_argument("--aider-batch", type=int, default=0, help="aider whole-format examples per step; 0 = none")
    ap.add_argument("--tool-batch", type=int, default=0,
                    help="short tool-call prompts per step, tool names drawn from a pool (any client's tools, the "
                         "openai-agents SDK's shape); 0 = none")
    ap.add_argument("--agent-weight", type=float, default=1.0, help="weight of the agent examples' reply loss")
    ap.add_argument("--prepare", action="store_true",
                    help="only train the BPE and write the token cache (out/tokenizer, out/tokens.npz, ~10 MB): what "
                         "a GPU machine needs instead of the corpus")
    ap.add_argument("--eval", action="store_true", help="bits per byte on held-out text, per kind")
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--export", default=None, help="write the trained checkpoint (make-model layout) here")
    ap.add_argument("--snapshot", default=None,
                    help="at every save also export the weights (bf16) and the step here: small enough to travel "
                         "back from a lent machine, so training survives losing it (see --init-from)")
    ap.add_argument("--init-from", default=None,
                    help="start from a --snapshot (weights and step; the optimizer state starts fresh) when the "
                         "output directory has no checkpoint of its own")
    args = ap.parse_args(argv)
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.init_from and not (out / "tokenizer").exists():     # the snapshot's vocabulary, not a retrained one
        import shutil

        (out / "tokenizer").mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(args.init_from) / name, out / "tokenizer" / name)
    docs = functools.cache(lambda: load_documents(Path(args.corpus)))   # read only when a cache is missing
    raw = preset_config(args.preset)
    tok, tok_dir = build_tokenizer(out, docs, raw["vocab_size"], raw["max_position_embeddings"])
    special = json.loads((tok_dir / "tokenizer_config.json").read_text())
    ids = {v["content"]: int(k) for k, v in special.get("added_tokens_decoder", {}).items()}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    raw.update(eos_token_id=eos, pad_token_id=pad, bos_token_id=None, dtype="float32")
    cfg = config_from_dict(raw)
    streams = tokenize(out, tok, docs, pad)
    if args.chat_share > 0 and "chat" not in streams["train"]:
        from chat_data import chat_stream

        chat = chat_stream(docs(), tok, pad)
        for split in ("train", "heldout"):
            streams[split]["chat"] = np.asarray(chat[split], dtype=np.int32)
        save_tokens(out, streams)
    agents = None
    if args.agent_batch or args.aider_batch or args.tool_batch:
        agents = AgentData(out, docs, tok)
    recipe = {kind: {"train_tokens": int(len(streams["train"][kind])), "heldout_tokens": int(len(s))}
              for kind, s in streams["heldout"].items()}
    (out / "tokens.json").write_text(json.dumps(recipe, indent=2) + "\n")
    if args.prepare:
        print(json.dumps(recipe))
        return 0

    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True     # fp32 master weights, TF32 matmuls: the model is tiny
        torch.backends.cudnn.allow_tf32 = True
    model = build_model(cfg, args.seed, args.device)
    # PyTorch paths everywhere: flash-linear-attention's chunked backward refuses Hopper with Triton < 3.7.1
    # (wrong gradients, fla #640), and the model's own chunked delta rule is differentiable.
    model.set_kernels(KernelFlags.parse("none"))
    if args.train_only:
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(args.train_only))
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    ckpt = out / "checkpoint.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=args.device, weights_only=False)
        model.load_state_dict(state["model"])
        if not (args.eval or args.export):           # evaluating or exporting needs the weights only
            opt.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"resumed at step {step}")
    elif args.init_from:
        step = init_from_snapshot(model, Path(args.init_from))
        print(f"started from snapshot {args.init_from} at step {step} (fresh optimizer state)")

    def save() -> None:
        tmp = out / "checkpoint.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "args": vars(args)},
                   tmp)
        tmp.replace(ckpt)
        if args.snapshot:
            export(model, raw, tok_dir, Path(args.snapshot))
            (Path(args.snapshot) / "train_state.json").write_text(json.dumps({"step": step}) + "\n")

    log = (out / "log.jsonl").open("a")
    stop_at = args.max_steps if args.max_steps is not None else args.total_steps
    model.train()
    while step < stop_at and not args.eval and args.export is None:
        if time.time() - t_start > args.minutes * 60:
            print(f"time limit: stopping at step {step}")
            break
        t0 = time.time()
        model._dense_phase = step < args.distill_steps
        lr = lr_at(step, args.total_steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = batch_for_step(streams["train"], step, args.seed, args.batch, args.seq, args.chat_share)
        losses = forward_losses(model, tokens)
        total = losses["ce"] + sum(LOSS_WEIGHTS[k] * losses[k] for k in LOSS_WEIGHTS)
        if agents is not None:
            group, fresh = agents.for_step(args.seed, step, args.agent_batch, args.aider_batch, args.tool_batch)
            losses.update(agent_losses(model, group, fresh))
            total = total + args.agent_weight * (losses["agent_ce"]
                                                 + LOSS_WEIGHTS["moe_balance"] * losses["agent_moe_balance"])
        opt.zero_grad(set_to_none=True)
        total.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        dt = time.time() - t0
        rec = {"step": step, "loss": total.item(), **{k: v.item() for k, v in losses.items()}, "lr": lr,
               "grad_norm": float(gnorm), "dense": model._dense_phase, "seconds": dt,
               "tokens_per_s": args.batch * args.seq / dt}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % 20 == 0 or step == 1:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()),
                  flush=True)
        if step % args.save_every == 0:
            save()
    if not args.eval and args.export is None:
        save()
    if args.eval:
        res = evaluate(model, streams, tok, min(args.seq, 256), args.eval_tokens)
        if agents is not None:
            res.update(agents.evaluate(model))
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        print(f"{'kind':>8} {'tokens':>8} {'model bpb':>10} {'unigram bpb':>12} {'ratio':>6}")
        for kind, r in res.items():
            if "reply_ce" in r:
                print(f"{kind:>8} {r['tokens']:>8} reply CE {r['reply_ce']:.3f} nats/token")
                continue
            print(f"{kind:>8} {r['tokens']:>8} {r['model_bpb']:>10.3f} {r['unigram_bpb']:>12.3f} {r['ratio']:>6.2f}")
    if args.export:
        export(model, raw, tok_dir, Path(args.export))
        print(f"exported to {args.export}")
    return 0


class AgentData:
    """Agent-shaped examples for a step (`tools/agent_data.py`), a function of (seed, step) only. Its sources (a
    small JSON file, out/agent_sources.json) are made from the corpus once, so a GPU machine needs no corpus."""

    EVAL_SEED = 10**6

    def __init__(self, out: Path, docs, tok) -> None:
        import agent_data

        self.mod = agent_data
        path = out / "agent_sources.json"
        if not path.exists():
            path.write_text(json.dumps(agent_data.sources(docs())))
        self.src = json.loads(path.read_text())
        self.prompts = agent_data.load_prompts()
        self.render = agent_data.Renderer(tok)

    def for_step(self, seed: int, step: int, n_group: int, n_aider: int, n_tool: int = 0, split: str = "train"):
        """(qwen-code group or None, fresh batches: aider's, short tool prompts')."""
        rng = np.random.default_rng([seed, step, 13])
        src = self.src[split]
        group = self.mod.qwen_code_group(rng, src, self.prompts, self.render, n_group, 16) if n_group else None
        aider = [self.mod.aider_example(rng, src, self.prompts, self.render) for _ in range(n_aider)]
        tools = [self.mod.tool_example(rng, src, self.render) for _ in range(n_tool)]
        return group, [b for b in (aider, tools) if b]

    @torch.no_grad()
    def evaluate(self, model: StageModel, groups: int = 4, n: int = 8) -> dict[str, dict[str, float]]:
        """Reply cross-entropy on examples no training step draws (another seed), per kind of example."""
        out = {}
        for kind in ("qwen_code", "aider", "tools"):
            total, count = 0.0, 0
            for g in range(groups):
                group, fresh = self.for_step(self.EVAL_SEED, g, *(n * (kind == k) for k in ("qwen_code", "aider",
                                                                                         "tools")))
                examples = group.examples if group else fresh[0]
                tokens = sum(len(e.ids) - e.reply_start for e in examples)
                total += agent_losses(model, group, fresh)["agent_ce"].item() * tokens
                count += tokens
            out[kind] = {"tokens": count, "reply_ce": total / count}
        return out


def export(model: StageModel, raw: dict, tok_dir: Path, dest: Path) -> None:
    """The trained weights in the make-model layout, bf16 (the served dtype)."""
    tables = {int(k): l.ple.table.weight for k, l in model.layers.items() if l.ple is not None}
    state = {k: v for k, v in model.state_dict().items() if ".ple.table." not in k}
    export_checkpoint(config_from_dict(dict(raw, dtype="bfloat16")), dest, state, tables, tok_dir)


def init_from_snapshot(model: StageModel, snapshot: Path) -> int:
    """Load exported weights (and the PLE tables) into the training model; returns the snapshot's step."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    device = next(model.parameters()).device
    loaded = load_model(snapshot, LoadOptions(with_mtp=True, dtype=torch.float32))
    missing, unexpected = model.load_state_dict({k: v.to(device) for k, v in loaded.state_dict().items()},
                                                strict=False)
    if unexpected or any(".ple.table." not in k for k in missing):
        raise SystemExit(f"snapshot {snapshot} does not fit the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for key, layer in model.layers.items():
            if layer.ple is not None:
                table = loaded.layers[key].ple.table.tensor
                table = table() if callable(table) else table
                layer.ple.table.weight.copy_(table.float().to(device))
    state = snapshot / "train_state.json"      # absent in an export (shared/demo_model): a fine-tune starts at 0
    return json.loads(state.read_text())["step"] if state.exists() else 0


if __name__ == "__main__":
    sys.exit(main())
