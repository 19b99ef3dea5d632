"""gateway/grammar.py: grammar-constrained sampling with llguidance, driven by random tokens over the built-in tokenizer

Each generation test plays the sampler: every step it takes the mask, picks a random allowed token (numpy RNG, fixed
seed), accepts it, and stops when the state says finished. For the first WARMUP steps closing tokens (EOS, `}`, `]`,
`</tool_call>`) are rarely picked, so outputs get some content; after that the pick is weighted towards closing tokens
(and `"`) and away from opening ones (`{`, `[`), so random walks end well inside the step cap. Every allowed token
keeps a nonzero chance, so the walks still wander through the grammar.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")

from gateway.grammar import GrammarCompiler, GrammarError, GrammarState, mask_to_bool, mask_words  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402

# The tiny model's embedding has exactly as many rows as its tokenizer has ids; pretend it has more (as real
# checkpoints often do, padded to a multiple of 64/128) so the tests see ids the tokenizer lacks.
EXTRA_IDS = 70
MAX_STEPS = 400
WARMUP = 20


@pytest.fixture(scope="module")
def tok(tiny_checkpoint) -> Tokenizer:
    # The random walk's weights are tuned to the tiny preset's tokenizer (mostly short pieces); the demo model's
    # BPE has long word pieces that keep a walk inside JSON strings far longer. test_agents.py covers the demo.
    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.fixture(scope="module")
def compiler(tok, tiny_checkpoint) -> GrammarCompiler:
    return GrammarCompiler(tiny_checkpoint, tok.eos_token_ids, tok.vocab_size + EXTRA_IDS)


@pytest.fixture(scope="module")
def weights(tok, compiler) -> tuple[np.ndarray, np.ndarray]:
    """(per-token sampling weight, closing-token flags) for the random walk (see the module doc)."""
    w = np.ones(compiler.vocab_size)
    closer = np.zeros(compiler.vocab_size, dtype=bool)
    for i in range(tok.vocab_size):
        b = compiler.ll_tokenizer.decode_bytes([i])
        if b"}" in b or b"]" in b:
            w[i], closer[i] = 20.0, True
        elif b'"' in b:
            w[i] = 5.0
        elif b"{" in b or b"[" in b:
            w[i] = 0.3
    ends = [*tok.eos_token_ids, tok.token_to_id("</tool_call>")]
    w[ends], closer[ends] = 30.0, True
    return w, closer


def drive(compiler, state: GrammarState, tok, weights, rng, adjust=None) -> list[int]:
    """Sample random allowed tokens until the state is finished; return the accepted ids (EOS included if taken)."""
    ids: list[int] = []
    buf = np.empty(compiler.n_words, dtype=np.int32)
    for _ in range(MAX_STEPS):
        if state.is_finished():
            break
        state.fill_mask(buf)
        allowed = np.flatnonzero(mask_to_bool(buf, compiler.vocab_size))
        assert allowed.size, "empty mask"
        assert allowed.max() < tok.vocab_size, "an id the tokenizer does not have was allowed"
        eos_allowed = np.isin(tok.eos_token_ids, allowed).any()
        assert eos_allowed == state.is_accepting(), "EOS must be allowed exactly where the grammar may end"
        w = weights[0][allowed].copy()
        if len(ids) < WARMUP:
            w[weights[1][allowed]] *= 1e-3
        if adjust is not None:
            w = adjust(ids, allowed, w)
        if w.sum() == 0:
            w = np.ones_like(w)
        token = int(rng.choice(allowed, p=w / w.sum()))
        assert state.accept(token), state.error
        ids.append(token)
    assert state.is_finished(), f"not finished after {MAX_STEPS} steps: {tok.decode(ids, skip_special_tokens=False)!r}"
    assert state.error is None
    return ids


def text_of(tok, ids: list[int]) -> str:
    return tok.decode([i for i in ids if i not in tok.eos_token_ids], skip_special_tokens=False)


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "age", "address"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "ids": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
        },
        "required": ["ids", "points"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "XL"]},
            "mixed": {"enum": [1, "one", None, True]},
            "version": {"const": 42},
        },
        "required": ["color", "size", "mixed", "version"],
        "additionalProperties": False,
    },
    "scalars": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
            "flag": {"type": "boolean"},
            "nothing": {"type": "null"},
        },
        "required": ["x", "n", "flag", "nothing"],
        "additionalProperties": False,
    },
    "strings": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "note": {"type": "string", "minLength": 2, "maxLength": 8},
            "when": {"type": "string", "format": "date"},
        },
        "required": ["code", "note", "when"],
        "additionalProperties": False,
    },
    "optional_and_refs": {
        "type": "object",
        "$defs": {"tag": {"type": "string", "maxLength": 6}},
        "properties": {
            "id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "extra": {"type": "object"},
        },
        "required": ["id"],
    },
    "top_level_array": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 2},
}


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_random_walk(compiler, tok, weights, name, seed):
    schema = SCHEMAS[name]
    state = compiler.new_matcher(compiler.json_schema(schema, strict=True))
    ids = drive(compiler, state, tok, weights, np.random.default_rng(seed))
    value = json.loads(text_of(tok, ids))
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_object(compiler, tok, weights, seed):
    state = compiler.new_matcher(compiler.json_object())
    ids = drive(compiler, state, tok, weights, np.random.default_rng(seed))
    assert isinstance(json.loads(text_of(tok, ids)), dict)


def test_compact_json_whitespace(compiler, tok):
    """Default JSON form is json.dumps': ", " and ": " only; other whitespace is refused."""
    spec = compiler.json_schema(SCHEMAS["scalars"], strict=True)
    good = compiler.new_matcher(spec)
    assert all(good.accept(i) for i in tok.encode('{"x": 1.5, "n": 3, "flag": true, "nothing": null}'))
    assert good.is_finished() and good.error is None
    bad = compiler.new_matcher(spec)
    assert not all(bad.accept(i) for i in tok.encode('{ "x":1.5}'))
    assert bad.error


# ---- tool calls -------------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
]
SCHEMA_OF = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
BLOCK = r'<tool_call>\n(\{"name": "([^"]+)", "arguments": .*?\})\n</tool_call>'


def check_calls(text: str, allowed_names) -> list[str]:
    assert re.fullmatch(f"{BLOCK}(?:\\n{BLOCK})*", text, flags=re.S), text
    names = []
    for body, name in re.findall(BLOCK, text, flags=re.S):
        call = json.loads(body)
        assert list(call) == ["name", "arguments"] and call["name"] == name
        assert name in allowed_names
        assert body.startswith(f'{{"name": "{name}", "arguments": ')
        jsonschema.validate(call["arguments"], SCHEMA_OF[name])
        names.append(name)
    return names


@pytest.mark.parametrize("seed", range(6))
def test_tool_calls_required(compiler, tok, weights, seed):
    state = compiler.new_matcher(compiler.tool_calls(TOOLS, "required", parallel=False))
    ids = drive(compiler, state, tok, weights, np.random.default_rng(seed))
    assert ids[0] == tok.token_to_id("<tool_call>")  # the tag is the single added token, not spelled out
    names = check_calls(text_of(tok, ids), SCHEMA_OF)
    assert len(names) == 1


@pytest.mark.parametrize("seed", range(3))
def test_tool_calls_named(compiler, tok, weights, seed):
    choice = {"type": "function", "function": {"name": "add"}}
    state = compiler.new_matcher(compiler.tool_calls(TOOLS, choice, parallel=False))
    ids = drive(compiler, state, tok, weights, np.random.default_rng(seed))
    assert check_calls(text_of(tok, ids), {"add"}) == ["add"]


@pytest.mark.parametrize("seed", range(3))
def test_tool_calls_parallel(compiler, tok, weights, seed):
    close, eos = tok.token_to_id("</tool_call>"), tok.eos_token_ids

    def at_least_three(ids, allowed, w):  # refuse EOS until three calls are out, so parallel calls really happen
        if sum(i == close for i in ids) < 3:
            w[np.isin(allowed, eos)] = 0
        return w

    state = compiler.new_matcher(compiler.tool_calls(TOOLS, "required", parallel=True))
    ids = drive(compiler, state, tok, weights, np.random.default_rng(seed), adjust=at_least_three)
    assert ids[-1] in eos
    assert len(check_calls(text_of(tok, ids), SCHEMA_OF)) >= 3


def test_tool_call_exact_text(compiler, tok):
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    )
    single = compiler.new_matcher(compiler.tool_calls(TOOLS, "required", parallel=False))
    ids = tok.encode(text)
    first = ids.index(tok.token_to_id("</tool_call>")) + 1
    assert all(single.accept(i) for i in ids[:first]) and single.is_finished()
    multi = compiler.new_matcher(compiler.tool_calls(TOOLS, "required", parallel=True))
    assert all(multi.accept(i) for i in ids) and multi.is_accepting() and not multi.is_finished()
    named = compiler.new_matcher(compiler.tool_calls(TOOLS, {"type": "function", "function": {"name": "add"}}, False))
    assert not all(named.accept(i) for i in ids[:first])  # get_weather is not the chosen function


def test_tool_call_errors(compiler):
    with pytest.raises(GrammarError, match="nope"):
        compiler.tool_calls(TOOLS, {"type": "function", "function": {"name": "nope"}}, parallel=False)
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    with pytest.raises(GrammarError, match="nonsense"):
        compiler.tool_calls(bad, "required", parallel=False)
    with pytest.raises(GrammarError):
        compiler.tool_calls([], "required", parallel=False)
    with pytest.raises(GrammarError, match="name"):
        compiler.tool_calls([{"type": "function", "function": {}}], "required", parallel=False)
    with pytest.raises(GrammarError):
        compiler.tool_calls(TOOLS, "auto", parallel=False)


def test_a_schema_with_nothing_to_generate_is_refused(compiler):
    """{"$ref": "#"} (and wrappers of it) compile to a grammar that is done before it starts: 200 with empty,
    non-JSON content unless refused."""
    for schema in ({"$ref": "#"}, {"allOf": [{"$ref": "#"}]}):
        with pytest.raises(GrammarError, match="admits no output"):
            compiler.json_schema(schema)
    assert compiler.json_schema({"type": "object", "properties": {"next": {"$ref": "#"}}})   # recursion with a base


def _accepts(compiler, spec: str, tok, text: str) -> bool:
    """The whole text is accepted and the grammar may end there."""
    state = compiler.new_matcher(spec)
    return all(state.accept(i) for i in tok.encode(text)) and state.is_accepting()


WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_tool_calls_or_json_answer(compiler, tok):
    """response_format with callable tools: a call, or JSON matching the answer schema; nothing else, no mix."""
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = compiler.tool_calls(TOOLS, "auto", parallel=True, answer=answer)
    assert _accepts(compiler, spec, tok, WEATHER_CALL + "\n" + ADD_CALL)
    assert _accepts(compiler, spec, tok, '{"ok": true}')
    for bad in ('{"ok": 1}', "hello", '{"ok": true}' + ADD_CALL, ADD_CALL + '{"ok": true}', '{"ok": true, "x": 1}'):
        assert not _accepts(compiler, spec, tok, bad), bad


def test_allowed_tools_restrict_calls(compiler, tok):
    required = compiler.tool_calls(TOOLS, "required", parallel=False, allowed=["add"])
    assert _accepts(compiler, required, tok, ADD_CALL) and not _accepts(compiler, required, tok, WEATHER_CALL)
    auto = compiler.tool_calls(TOOLS, "auto", parallel=False, allowed=["add"])
    assert _accepts(compiler, auto, tok, "Sure, adding. " + ADD_CALL) and _accepts(compiler, auto, tok, "no call")
    assert not _accepts(compiler, auto, tok, WEATHER_CALL)
    assert not _accepts(compiler, auto, tok, "text <tool_call> spelled out")    # the tag only opens an allowed call
    with pytest.raises(GrammarError, match="nope"):
        compiler.tool_calls(TOOLS, "required", parallel=False, allowed=["nope"])


@pytest.mark.parametrize("strict", [True, False])
def test_one_of_exact_or_refused(compiler, tok, strict):
    """Disjoint alternatives are enforced exactly; overlapping ones (an integer is also a number) would be loosened
    to anyOf by lenient llguidance, so they are refused in both modes, naming oneOf."""
    with pytest.raises(GrammarError, match="oneOf"):
        compiler.json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}, strict=strict)
    with pytest.raises(GrammarError, match="oneOf"):
        bad = [{"type": "function", "function": {"name": "f", "strict": strict, "parameters": {
            "type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}}}]
        compiler.tool_calls(bad, "required", parallel=False)
    spec = compiler.json_schema({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}, strict=strict)
    assert _accepts(compiler, spec, tok, "12") and _accepts(compiler, spec, tok, '"ab"')
    assert not _accepts(compiler, spec, tok, "true")


# ---- schema errors, strictness, cache -----------------------------------------------------------------------------


def test_invalid_schema(compiler):
    for strict in (True, False):
        with pytest.raises(GrammarError, match="nonsense"):
            compiler.json_schema({"type": "nonsense"}, strict=strict)
    with pytest.raises(GrammarError):
        compiler.json_schema("not a schema", strict=True)  # type: ignore[arg-type]
    with pytest.raises(GrammarError):
        compiler.json_schema(False, strict=True)  # type: ignore[arg-type]
    assert issubclass(GrammarError, ValueError)


def test_strict_refuses_unimplemented_keywords(compiler, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}, "required": ["a"]}
    with pytest.raises(GrammarError, match="not"):
        compiler.json_schema(schema, strict=True)
    state = compiler.new_matcher(compiler.json_schema(schema, strict=False))  # enforced, minus the "not"
    assert all(state.accept(i) for i in tok.encode('{"a": 7}'))
    assert state.is_finished()


def test_cache_is_lru_and_recompiles(tok, tiny_checkpoint):
    small = GrammarCompiler(tiny_checkpoint, tok.eos_token_ids, tok.vocab_size, cache_size=1)
    a = small.json_schema(SCHEMAS["scalars"], strict=True)
    b = small.json_object()
    assert small.json_schema(SCHEMAS["scalars"], strict=True) == a
    assert len(small._cache) == 1
    for spec, text in ((a, '{"x": 0, "n": 1, "flag": false, "nothing": null}'), (b, "{}")):  # `b` was evicted
        state = small.new_matcher(spec)
        assert all(state.accept(i) for i in tok.encode(text)) and state.is_finished()


# ---- mask semantics -----------------------------------------------------------------------------------------------


def test_mask_layout_and_refusal(compiler, tok):
    assert compiler.n_words == mask_words(tok.vocab_size + EXTRA_IDS) == (tok.vocab_size + EXTRA_IDS + 31) // 32
    state = compiler.new_matcher(compiler.json_object())
    words = state.mask()
    assert words.dtype == np.int32 and words.shape == (compiler.n_words,)
    allowed = mask_to_bool(words, compiler.vocab_size)
    starts = np.flatnonzero(allowed)
    assert tok.token_to_id("{") in starts  # the object must open with "{" ('{"' is a token too)
    assert all(compiler.ll_tokenizer.decode_bytes([int(i)]).startswith(b"{") for i in starts)
    manual = [(int(words[i // 32]) >> (i % 32)) & 1 for i in range(compiler.vocab_size)]
    assert manual == allowed.astype(int).tolist()
    refused = tok.encode("a")[0]
    assert not allowed[refused]
    assert state.accept(refused) is False
    assert state.error and state.is_finished()
    assert state.accept(tok.token_to_id("{")) is False  # an errored state stays errored

    for bad in (tok.vocab_size + 5, -1, compiler.vocab_size):  # ids outside the tokenizer / the model
        s = compiler.new_matcher(compiler.json_object())
        assert s.accept(bad) is False and s.error


def test_eos_only_when_complete(compiler, tok):
    eos = tok.eos_token_ids
    state = compiler.new_matcher(compiler.json_schema({"type": "integer"}, strict=True))
    assert not mask_to_bool(state.mask(), compiler.vocab_size)[eos].any()
    assert state.accept(eos[0]) is False

    state = compiler.new_matcher(compiler.json_schema({"type": "integer"}, strict=True))
    assert state.accept(tok.encode("7")[0])
    allowed = mask_to_bool(state.mask(), compiler.vocab_size)
    assert allowed[eos].all() and allowed[tok.encode("3")[0]]  # may end, or go on: "73"
    assert state.is_accepting() and not state.is_finished()
    assert state.accept(eos[0]) and state.is_finished() and state.error is None

    obj = compiler.new_matcher(compiler.json_schema({"type": "object", "additionalProperties": False}, strict=True))
    assert obj.accept(tok.token_to_id("{"))
    assert not mask_to_bool(obj.mask(), compiler.vocab_size)[eos].any()
    assert obj.accept(tok.token_to_id("}"))
    assert obj.is_finished()  # complete and nothing can follow: the request stops without sampling EOS
    assert np.flatnonzero(mask_to_bool(obj.mask(), compiler.vocab_size)).tolist() == sorted(eos)


def test_fill_mask_checks_the_buffer(compiler):
    state = compiler.new_matcher(compiler.json_object())
    with pytest.raises(ValueError):
        state.fill_mask(np.zeros(compiler.n_words, dtype=np.int64))
    out = np.empty(compiler.n_words, dtype=np.int32)
    state.fill_mask(out)
    assert np.array_equal(out, state.mask())


def test_for_tokenizer_and_mask_bytes(tok):
    compiler = GrammarCompiler.for_tokenizer(tok, vocab_size=tok.vocab_size + EXTRA_IDS)
    assert compiler.eos_token_ids == tok.eos_token_ids and compiler.vocab_size == tok.vocab_size + EXTRA_IDS
    state = compiler.new_matcher(compiler.json_schema({"type": "boolean"}, strict=True))
    data = state.mask_bytes()
    assert len(data) == compiler.n_words * 4
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")[: compiler.vocab_size].astype(bool)
    assert np.array_equal(bits, mask_to_bool(state.mask(), compiler.vocab_size))
    assert bits[tok.encode("true")[0]] and not bits[tok.encode("1")[0]]
    assert GrammarCompiler.for_tokenizer(tok).vocab_size == tok.vocab_size


def test_mask_to_bool_batch():
    words = np.array([[1, 0], [-1, -(1 << 31)]], dtype=np.int32)  # bit 31 set = the sign bit
    got = mask_to_bool(words, 40)
    assert got.shape == (2, 40)
    assert np.flatnonzero(got[0]).tolist() == [0]
    assert got[1, :32].all() and not got[1, 32:].any()
    assert mask_to_bool(words, 64)[1, 63]


@pytest.mark.parametrize("forced", ["</tool_call>", "<|im_end|>", "a</think>b<tool_call>x"])
def test_forced_text_of_an_added_token_is_spelled(compiler, tok, weights, forced):
    """A grammar that forces the text of an added token (a schema const, a regex): llguidance's mask allowed only
    that token, which its matcher then refused as special, so the request failed (500). The text comes out spelled
    in ordinary tokens, and the grammar still finishes."""
    if any(tok.token_to_id(t) is None for t in ("</tool_call>", "<|im_end|>")):
        pytest.skip("the tokenizer lacks the added tokens")
    rng = np.random.default_rng(0)
    spec = compiler.json_schema({"type": "object", "properties": {"s": {"const": forced}}, "required": ["s"]})
    ids = drive(compiler, compiler.new_matcher(spec), tok, weights, rng)
    assert json.loads(text_of(tok, ids)) == {"s": forced}
    ids = drive(compiler, compiler.new_matcher(compiler.regex(re.escape(forced))), tok, weights, rng)
    assert text_of(tok, ids) == forced
