"""Prompt logprobs end to end: what lm-eval's loglikelihood requests (`/v1/completions` with echo, logprobs and
max_tokens 0) and vLLM's `prompt_logprobs` extra read.

- The engine (in-process, 2 stages, prefill in 16-token chunks) returns for every prompt position the prompt token's
  logprob and rank and the k most likely tokens, equal to one full forward of the model (fp32 log_softmax), also for
  a prompt the prefix cache holds (such a request takes no hit), and a request that does not ask computes no extra
  logits rows.
- Served (real uvicorn over the in-process engine, the `openai` client): echo + logprobs + max_tokens 0, vLLM's
  `prompt_logprobs` on completions and chat, streamed too; n > 1 computes the prompt's logprobs once; bad values
  are 400s naming the field.
- The 2-stage cluster of the "api" group (`moepipe serve --stages 2`, real processes): the same values after the
  messages' round trip through msgpack.
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import torch

from conftest import InProcessServer, OpenAI, collect_events, small_cluster
from gateway.api import create_app
from gateway.engine import AsyncEngine
from gateway.metrics import Metrics
from shared.engine_core import GenerationRequest
from shared.protocol import PromptLogprobs, StepResult, TokenOut, decode, encode
from shared.sampling import SamplingParams, read_generation_config
from shared.tokenizer import Tokenizer
from stage_worker.checkpoint.loader import load_model
from stage_worker.inprocess_executor import local_engine_core
from stage_worker.local_engine import LocalEngine

MODEL = "tiny-test"
PROMPT_IDS = [(i * 37) % 900 + 10 for i in range(50)]          # > 3 chunks of 16 tokens
TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs back into the forest where the other "
        "animals are waiting for the night to fall.")
TOL = 1e-4


class Reference:
    """log_softmax (fp32) of one full forward of the whole prompt, every position's row."""

    def __init__(self, model_dir) -> None:
        self.model = load_model(model_dir)

    def rows(self, ids: list[int]) -> torch.Tensor:
        engine = LocalEngine([self.model], max_seqs=1, max_tokens=len(ids) + 16)
        engine.add(0)
        return torch.log_softmax(engine.step([(0, ids)], all_logits=True).float(), dim=-1)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> Reference:
    return Reference(tiny_checkpoint)


def assert_matches(ids: list[int], got: PromptLogprobs, rows: torch.Tensor, top: int) -> None:
    """`got` scores ids[1:] as the full forward does: logprob, rank (within the tolerance's ties), top-k."""
    assert len(got) == len(ids) - 1 and got.top == top
    lp, ranks, top_ids, top_vals = got.arrays()
    want = rows[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert np.abs(lp - want.numpy()).max() < TOL
    lo = (rows[:-1] > want[:, None] + TOL).sum(-1) + 1
    hi = (rows[:-1] >= want[:, None] - TOL).sum(-1)
    assert ((lo.numpy() <= ranks) & (ranks <= hi.numpy())).all()
    if top:
        vals, _ = rows[:-1].topk(top, dim=-1)
        assert np.abs(top_vals - vals.numpy()).max() < TOL
        picked = rows[:-1].gather(1, torch.from_numpy(top_ids.astype(np.int64)))
        assert np.abs(picked.numpy() - top_vals).max() < TOL     # each id's own logprob (ties may swap ids)


# ---- the engine ---------------------------------------------------------------------------------------------------

def test_engine_prompt_logprobs_equal_a_full_forward_over_chunks_and_a_warm_prefix(tiny_checkpoint, reference):
    gen = read_generation_config(tiny_checkpoint)
    core = local_engine_core(tiny_checkpoint, stages=2, max_model_len=128, max_num_batched_tokens=16,
                             block_size=16, prefix_cache_states=4)
    last = core.executor.runners[-1]
    rows_seen: list[tuple[int, int]] = []          # (logits rows, rows the plan asked for) of every step
    sample_step = last.sampler.sample

    def spy(plan, batch, logits, requests):
        rows_seen.append((logits.shape[0], sum(e.num_tokens if e.prompt_logprobs else int(e.sample)
                                               for e in plan.entries)))
        return sample_step(plan, batch, logits, requests)

    last.sampler.sample = spy
    try:
        def params(**kw):
            return SamplingParams(max_tokens=2, temperature=0.0, **kw).with_defaults(gen)

        plain = collect_events(core, [GenerationRequest("warm", PROMPT_IDS, params())])[0]
        assert plain[0].prompt_logprobs is None
        # a request that does not ask computes one logits row per sampled token, nothing more
        assert rows_seen and all(n == want for n, want in rows_seen) and max(n for n, _ in rows_seen) == 1
        again = collect_events(core, [GenerationRequest("hit", PROMPT_IDS, params())])[0]
        assert again[0].cached_tokens > 0                          # the prompt is in the prefix cache
        rows_seen.clear()
        hits = core.scheduler.prefix.hits
        asked = collect_events(core, [GenerationRequest("pl", PROMPT_IDS, params(logprobs=1), prompt_logprobs=5),
                                      GenerationRequest("zero", PROMPT_IDS, params(), prompt_logprobs=0)])
        assert core.scheduler.prefix.hits == hits and asked[0][0].cached_tokens == 0    # no hit for them
        assert max(n for n, _ in rows_seen) == 16 and all(n == want for n, want in rows_seen)   # chunk by chunk
    finally:
        core.stop()
    rows = reference.rows(PROMPT_IDS)
    assert_matches(PROMPT_IDS, asked[0][0].prompt_logprobs, rows, 5)
    assert_matches(PROMPT_IDS, asked[1][0].prompt_logprobs, rows, 0)
    assert [e.token_id for e in asked[0]] == [e.token_id for e in plain]
    assert asked[0][1].prompt_logprobs is None                      # the first event alone carries them


def test_prompt_logprobs_cross_processes_as_raw_arrays():
    pl = PromptLogprobs.build(np.array([-1.5, -0.25]), np.array([3, 1]), np.array([[7, 8], [9, 4]]),
                              np.array([[-0.1, -2.0], [-0.25, -3.0]]))
    msg = StepResult(step=3, microbatch=0, tokens=[TokenOut("r", 5, 11, prompt_logprobs=pl),
                                                   TokenOut("s", 1, 2, logprob=-0.5)])
    back = decode([bytes(f) for f in encode(msg)])
    assert back.tokens[0].prompt_logprobs == pl and back.tokens[1].prompt_logprobs is None
    lp, ranks, ids, vals = back.tokens[0].prompt_logprobs.arrays()
    assert lp.tolist() == [-1.5, -0.25] and ranks.tolist() == [3, 1] and ids.tolist() == [[7, 8], [9, 4]]
    joined = PromptLogprobs.join([pl, pl])
    assert len(joined) == 4 and joined.arrays()[2].shape == (4, 2) and len(PromptLogprobs.join([], 3)) == 0


# ---- served: the in-process engine behind uvicorn -----------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    tok = Tokenizer.from_dir(tiny_checkpoint)
    backend = local_engine_core(tiny_checkpoint, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                                block_size=16)
    added: list[GenerationRequest] = []
    add = backend.add

    def spy(request, sink):
        added.append(request)
        return add(request, sink)

    backend.add = spy
    metrics = Metrics()
    app = create_app(AsyncEngine(backend), tok, model_name=MODEL,
                     generation_config=read_generation_config(tiny_checkpoint), metrics=metrics)
    with InProcessServer(app, backend) as url:
        yield url, tok, added


def _client(url: str):
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_vllm_list(plist, ids: list[int], rows: torch.Tensor, k: int) -> None:
    """vLLM's shape: None, then per position {id: {logprob, rank, decoded_token}} holding the prompt token and the
    k most likely (ranks 1..k)."""
    assert len(plist) == len(ids) and plist[0] is None
    for pos in range(1, len(ids)):
        entry, row = plist[pos], rows[pos - 1]
        own = entry[str(ids[pos])]
        assert math.isclose(own["logprob"], float(row[ids[pos]]), abs_tol=TOL) and isinstance(own["decoded_token"], str)
        # random weights' rows are nearly flat: the rank within the tolerance's near-ties
        assert int((row > row[ids[pos]] + TOL).sum()) + 1 <= own["rank"] <= int((row >= row[ids[pos]] - TOL).sum())
        assert k <= len(entry) <= k + 1           # the prompt token is one of the k best, or one more
        top = entry if len(entry) == k else {t: v for t, v in entry.items() if t != str(ids[pos])}
        ranked = sorted((v["rank"], v["logprob"]) for v in top.values())
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        assert [lp for _, lp in ranked] == pytest.approx(row.topk(k).values.tolist() if k else [], abs=TOL)


def test_completions_echo_logprobs_max_tokens_0_is_lm_evals_loglikelihood(served, reference):
    url, tok, _ = served
    ids = tok.encode(TEXT)
    assert len(ids) > 16
    rows = reference.rows(ids)
    r = _client(url).completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=2,
                                        temperature=0)
    c = r.choices[0]
    assert c.text == TEXT and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[pos], float(rows[pos - 1, ids[pos]]), abs_tol=TOL)
        top = lp.top_logprobs[pos]
        assert lp.tokens[pos] in top and 2 <= len(top) <= 3
        # lm-eval's greedy test: the prompt token is the most likely one exactly when the model's argmax is it
        greedy = max(top.values()) == lp.token_logprobs[pos]
        assert greedy == (int(rows[pos - 1].argmax()) == ids[pos])
        assert max(top.values()) == pytest.approx(float(rows[pos - 1].max()), abs=TOL)
    # token ids in, as lm-eval sends them, and streamed: the first chunk carries the prompt's logprobs
    chunks = [ch for ch in _client(url).completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True,
                                                           logprobs=2, temperature=0, stream=True) if ch.choices]
    first = chunks[0].choices[0].logprobs
    assert chunks[0].choices[0].text == TEXT and first.tokens == lp.tokens
    assert first.token_logprobs[0] is None and first.top_logprobs[0] is None
    assert first.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)
    assert [set(t) for t in first.top_logprobs[1:]] == [set(t) for t in lp.top_logprobs[1:]]


def _lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness' LocalCompletionsAPI.parse_logprobs for one choice: the entries after the context but
    the last (the generated token) are the continuation's."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_lm_eval_local_completions_loglikelihood_payload(served, reference):
    """What lm-eval's `local-completions` sends for loglikelihood: token-id prompts (a batch), max_tokens 1,
    logprobs 1, echo. Its parser's sum equals the full forward's continuation logprob, and its greedy flag the
    argmax test, also when the generated token is a stop token (`stop_token_ids` here; EOS alike): with echo it
    keeps its logprobs entry, which the parser drops as the generated one."""
    url, tok, _ = served
    ctx = tok.encode(TEXT)
    prompts = [ctx + tok.encode(" and sleeps"), ctx + tok.encode(" of the")]
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60, verify=False)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices):
        rows = reference.rows(ids)
        cont = range(len(ctx), len(ids))
        want = sum(float(rows[p - 1, ids[p]]) for p in cont)
        greedy = all(int(rows[p - 1].argmax()) == ids[p] for p in cont)
        got, got_greedy = _lm_eval_parse(choice, len(ctx))
        assert got == pytest.approx(want, abs=1e-3) and got_greedy == greedy
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 1
        # the same request ending on a stop token: the entry is still there
        nxt = int(rows[-1].argmax())
        stopped = httpx.post(url + "/v1/completions", json={**body, "prompt": ids, "stop_token_ids": [nxt]},
                             timeout=60, verify=False).json()["choices"][0]
        assert stopped["finish_reason"] == "stop" and stopped["text"] == tok.decode(ids, False)
        assert len(stopped["logprobs"]["tokens"]) == len(ids) + 1
        assert _lm_eval_parse(stopped, len(ctx)) == pytest.approx((got, got_greedy), abs=1e-4)


def test_vllm_prompt_logprobs_on_completions_and_chat(served, reference):
    url, tok, added = served
    client = _client(url)
    ids = tok.encode(TEXT)
    rows = reference.rows(ids)
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    body = r.model_dump()
    _check_vllm_list(body["choices"][0]["prompt_logprobs"], ids, rows, 3)
    assert body["choices"][0]["logprobs"] is None
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, temperature=0).model_dump()
    assert "prompt_logprobs" not in plain["choices"][0] and plain["choices"][0]["text"] == body["choices"][0]["text"]

    messages = [{"role": "user", "content": "Write a haiku about GPUs"}]
    chat_ids = tok.encode(tok.apply_chat_template(messages))
    chat_rows = reference.rows(chat_ids)
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0}).model_dump()
    _check_vllm_list(c["prompt_logprobs"], chat_ids, chat_rows, 0)
    assert all(len(e) == 1 for e in c["prompt_logprobs"][1:])
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, extra_body={"prompt_logprobs": 2}))
    carried = [ch.model_dump().get("prompt_logprobs") for ch in stream]
    assert carried[0] is not None and not any(carried[1:])
    _check_vllm_list(carried[0], chat_ids, chat_rows, 2)

    # n > 1: the prompt's first choice alone asks the engine; every choice shows the same prompt logprobs
    added.clear()
    two = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, n=2, temperature=0.9, seed=5,
                                    echo=True, logprobs=1, extra_body={"prompt_logprobs": 1}).model_dump()
    assert sorted(r.prompt_logprobs for r in added if r.prompt_logprobs is not None) == [1] and len(added) == 2
    a, b = two["choices"]
    assert a["prompt_logprobs"] == b["prompt_logprobs"] and a["prompt_logprobs"] is not None
    p = len(ids)
    assert a["logprobs"]["token_logprobs"][:p] == b["logprobs"]["token_logprobs"][:p]
    assert a["logprobs"]["top_logprobs"][:p] == b["logprobs"]["top_logprobs"][:p]


@pytest.mark.parametrize("value,says", [(21, "<= 20"), (-1, "whole vocabulary"), (-2, ">= 0"), ("3", "integer"),
                                        (True, "integer"), (1.5, "integer")])
def test_bad_prompt_logprobs_are_400s(served, value, says):
    url = served[0]
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})):
        r = httpx.post(url + path, json={"model": MODEL, "prompt_logprobs": value, **body}, timeout=60, verify=False)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt_logprobs" and says in err["message"] and err["type"] == "invalid_request_error"


# ---- the 2-stage cluster (real processes) --------------------------------------------------------------------------

def test_two_stage_cluster_serves_the_same_prompt_logprobs(tiny_checkpoint, reference):
    server = small_cluster(tiny_checkpoint)       # shared with the "api" group's files (conftest.SHARED_GROUPS)
    tok = Tokenizer.from_dir(tiny_checkpoint)
    client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)
    long_text = " ".join([TEXT] * 3)
    ids = tok.encode(long_text)
    assert len(ids) > 64                          # more than one of the cluster's prefill chunks
    rows = reference.rows(ids)
    r = client.completions.create(model="moepipe", prompt=long_text, max_tokens=0, echo=True, logprobs=2,
                                  temperature=0, extra_body={"prompt_logprobs": 2}).model_dump()
    c = r["choices"][0]
    assert c["logprobs"]["token_logprobs"][0] is None
    assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(
        rows[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), abs=TOL)
    _check_vllm_list(c["prompt_logprobs"], ids, rows, 2)
    messages = [{"role": "user", "content": "Write a haiku about GPUs"}]
    chat_ids = tok.encode(tok.apply_chat_template(messages))
    chat = client.chat.completions.create(model="moepipe", messages=messages, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 1}).model_dump()
    _check_vllm_list(chat["prompt_logprobs"], chat_ids, reference.rows(chat_ids), 1)
