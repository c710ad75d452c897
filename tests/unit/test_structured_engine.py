"""The grammar engine wrapper (flashvlm/structured/) on the tiny checkpoints' tokenizer, and the device-side mask
(runner/token_mask.py) against xgrammar's own CPU application on random inputs."""

from __future__ import annotations

import builtins
import json

import pytest
import torch

from flashvlm.request import InvalidRequestError, Request, SamplingParams
from flashvlm.runner.sampler import Sampler, SamplerInputs
from flashvlm.runner.token_mask import TokenMask, apply_token_mask, unpack_bitmask
from flashvlm.structured.grammar import GrammarEngine, choice_grammar
from flashvlm.structured.manager import StructuredOutputs
from flashvlm.structured.params import StructuredOutputsParams as Constraint
from flashvlm.testing.tiny_qwen import QWEN_CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS

xgr = pytest.importorskip("xgrammar")

VOCAB = 512  # the model's vocabulary: a little larger than the tokenizer's, as real checkpoints pad it


@pytest.fixture(scope="module")
def tokenizer():
    from flashvlm.testing.checkpoint_writer import build_tokenizer

    return build_tokenizer(QWEN_SPECIAL_TOKENS, 480, QWEN_CHAT_TEMPLATE, eos="<|im_end|>", bos=None, pad=None)


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputs:
    return StructuredOutputs(tokenizer, VOCAB, (tokenizer.eos_token_id,))


def _allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    return set(torch.nonzero(unpack_bitmask(bitmask, VOCAB)[row]).view(-1).tolist())


def _request(rid: str, spec: Constraint | None, eos: int) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=spec),
                   eos_token_ids=(eos,))


def test_params_shape_checks() -> None:
    assert Constraint(choice=["a", "b"]).choice == ("a", "b")
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == Constraint(regex="a+")
    assert Constraint(json='{"b": 1,  "a": 2}').schema_text() == '{"b": 1, "a": 2}'  # order is meaning: kept
    for bad, words in [({}, "exactly one"), ({"regex": "a", "json_object": True}, "exactly one"),
                       ({"choice": ["a", ""]}, "non-empty"), ({"json": "[1"}, "not valid JSON"),
                       ({"json": "3"}, "must be an object"), ({"grammar": 5}, "non-empty string")]:
        with pytest.raises(InvalidRequestError, match=words):
            Constraint(**bad)
    with pytest.raises(InvalidRequestError, match="unknown field"):
        Constraint.from_dict({"json_schema": {}})
    with pytest.raises(InvalidRequestError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")


def test_compile_errors_name_the_constraint(tokenizer) -> None:
    engine = GrammarEngine(tokenizer, VOCAB, (tokenizer.eos_token_id,))
    for spec, words in [(Constraint(regex="a("), "invalid structured_outputs regex: .*parenthesis"),
                        (Constraint(json={"type": "nothing"}), "JSON schema: .*nothing"),
                        (Constraint(grammar="root ::= other"), "grammar: .*other")]:
        with pytest.raises(InvalidRequestError, match=words):
            engine.compile(spec)


def test_a_constraint_no_token_can_begin_is_refused_at_compile() -> None:
    from flashvlm.bench.model_configs import QWEN_SPECIAL_IDS, word_tokenizer

    # The benchmark models' tokenizer: one word w<id> per id, every word holding digits.
    words = word_tokenizer(152000, QWEN_SPECIAL_IDS, "<|im_end|>", "<|endoftext|>")
    engine = GrammarEngine(words, 152064, (151645,))
    with pytest.raises(InvalidRequestError, match="regex: no token of this model's vocabulary can begin"):
        engine.compile(Constraint(regex="[a-z]+"))
    matcher = engine.matcher(Constraint(regex="(w7[0-9]*)+"))
    bitmask = torch.zeros((1, (152064 + 31) // 32), dtype=torch.int32)
    engine.fill_batch([matcher], bitmask, [0])
    allowed = torch.nonzero(unpack_bitmask(bitmask, 152064)[0]).view(-1).tolist()
    assert allowed == [i for i in range(152000) if str(i).startswith("7")]  # w7, w70 .. w79, w700 ...


def test_a_constraint_compiles_once_however_often_it_is_asked_for(tokenizer, monkeypatch) -> None:
    import xgrammar as xgr

    engine = GrammarEngine(tokenizer, VOCAB, (tokenizer.eos_token_id,))
    conversions = []
    real = xgr.Grammar.from_json_schema
    monkeypatch.setattr(xgr.Grammar, "from_json_schema", lambda *a, **k: conversions.append(1) or real(*a, **k))
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}
    first = engine.compile(Constraint(json=schema))
    assert engine.compile(Constraint(json=dict(schema))) is first  # an equal schema: the same compiled grammar
    assert engine.compile(Constraint(json='{"properties": {"a": {"type": "string", "maxLength": 3}}, '
                                           '"type": "object"}')) is not first  # another key order: another output
    assert len(conversions) == 2


def test_schemas_with_too_many_properties_are_refused() -> None:
    from flashvlm.structured.params import MAX_SCHEMA_PROPERTIES

    def schema(n: int) -> dict:
        half = {f"p{i}": {"type": "integer"} for i in range(n // 2)}
        return {"type": "object", "properties": {"nested": {"type": "object", "properties": half},
                                                 **{f"q{i}": {"type": "string"} for i in range(n - n // 2 - 1)}}}

    Constraint(json=schema(MAX_SCHEMA_PROPERTIES))
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_SCHEMA_PROPERTIES}"):
        Constraint(json=schema(MAX_SCHEMA_PROPERTIES + 1))


def test_missing_xgrammar_is_an_invalid_request(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_xgrammar(name: str, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    engine = GrammarEngine(tokenizer, VOCAB, (tokenizer.eos_token_id,))
    assert not engine.available()
    with pytest.raises(InvalidRequestError, match=r"pip install 'flashvlm\[structured\]'"):
        engine.compile(Constraint(regex="a"))


def test_matcher_walks_a_choice_then_allows_only_eos(tokenizer, manager: StructuredOutputs) -> None:
    eos = tokenizer.eos_token_id
    text = 'say "hi"\n'
    req = _request("r", Constraint(choice=[text, "other"]), eos)
    manager.add(req)
    for token in tokenizer.encode(text, add_special_tokens=False):
        mask = manager.bitmask([req])
        assert mask.rows == [0] and token in _allowed(mask.bitmask)
        req.output_token_ids.append(token)
        assert manager.advance([req]) == ([], [])
    assert _allowed(manager.bitmask([req]).bitmask) == {eos}
    req.output_token_ids.append(eos)
    assert manager.advance([req]) == ([], ["r"])
    assert _allowed(manager.bitmask([req]).bitmask) == {eos}  # padding after the end: stop tokens only
    manager.drop("r")
    assert len(manager) == 0


def test_advance_accepts_each_token_once_and_replays_when_behind(tokenizer, manager: StructuredOutputs) -> None:
    req = _request("a", Constraint(regex="abcabc"), tokenizer.eos_token_id)
    manager.add(req)
    ids = tokenizer.encode("abc", add_special_tokens=False)
    other = _request("b", Constraint(regex="abcabc"), tokenizer.eos_token_id)
    manager.add(other)
    req.output_token_ids.extend(ids)
    other.output_token_ids.append(ids[0])  # one new token: the batched accept
    assert manager.advance([req, other]) == ([], []) and manager.advance([req, other]) == ([], [])
    matcher = manager._matchers["a"]
    assert matcher.num_accepted == len(ids) and manager._matchers["b"].num_accepted == 1
    del req.output_token_ids[1:]  # fewer tokens than accepted: the matcher is rebuilt from the request's tokens
    assert manager.advance([req]) == ([], []) and matcher.num_accepted == 1
    z = tokenizer.encode("z", add_special_tokens=False)[0]
    req.output_token_ids.append(z)
    other.output_token_ids.append(z)
    assert manager.advance([req, other]) == (["a", "b"], [])  # outside the grammar, either path
    other.output_token_ids[1:] = [ids[1]]
    with pytest.raises(RuntimeError, match="has not accepted"):  # a token the engine's advance never saw
        manager.bitmask([other])
    manager.drop("a")
    manager.drop("b")


def test_bitmask_covers_only_constrained_rows(tokenizer, manager: StructuredOutputs) -> None:
    eos = tokenizer.eos_token_id
    reqs = [_request("p0", None, eos), _request("c1", Constraint(regex="[0-9]"), eos), _request("p2", None, eos),
            _request("c3", Constraint(json_object=True), eos)]
    for r in reqs:
        manager.add(r)
    assert len(manager) == 2
    mask = manager.bitmask(reqs)
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    assert mask.rows == [1, 3] and digits <= _allowed(mask.bitmask, 0) and _allowed(mask.bitmask, 0) <= digits | {
        t for t in range(VOCAB) if tokenizer.decode([t]).isdigit()}
    assert tokenizer.convert_tokens_to_ids("{") in _allowed(mask.bitmask, 1)
    assert manager.bitmask([reqs[0], reqs[2]]) is None
    for r in reqs:
        manager.drop(r.request_id)


def test_step_masks_follow_each_requests_own_tokens(tokenizer, manager: StructuredOutputs) -> None:
    # A step's mask rows are in the step's order, each for the tokens its request has now; they equal the masks of
    # a manager that saw each request alone.
    eos = tokenizer.eos_token_id
    a, b, c = (_request(r, Constraint(regex=rx), eos) for r, rx in (("a", "[0-9]+x"), ("b", "abcabc"), ("c", "[a-z]+")))
    for r in (a, b, c):
        manager.add(r)
    a.output_token_ids.append(tokenizer.encode("7", add_special_tokens=False)[0])
    b.output_token_ids.extend(tokenizer.encode("ab", add_special_tokens=False))
    manager.advance([a, b])
    step = manager.bitmask([c, a, b])
    fresh = StructuredOutputs(tokenizer, VOCAB, (eos,))
    for r in (a, b, c):
        fresh.add(r)
        fresh.advance([r])
    assert step.rows == [0, 1, 2]
    for row, r in enumerate((c, a, b)):
        assert torch.equal(step.bitmask[row], fresh.bitmask([r]).bitmask[0])
    assert _allowed(step.bitmask, 0) != _allowed(step.bitmask, 1) != _allowed(step.bitmask, 2)
    a.output_token_ids.append(tokenizer.encode("x", add_special_tokens=False)[0])
    manager.advance([a])
    assert _allowed(manager.bitmask([a]).bitmask) == {eos}
    for r in (a, b, c):
        manager.drop(r.request_id)


def test_masks_in_pinned_memory_when_asked(tokenizer) -> None:
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    pinned = StructuredOutputs(tokenizer, VOCAB, (tokenizer.eos_token_id,), pin_memory=True)
    req = _request("p", Constraint(regex="[0-9]+"), tokenizer.eos_token_id)
    pinned.add(req)
    assert pinned.bitmask([req]).bitmask.is_pinned()


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [0]])
def test_device_mask_matches_xgrammar_reference(rows: list[int]) -> None:
    g = torch.Generator().manual_seed(len(rows))
    logits = torch.randn(4, VOCAB, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (len(rows), (VOCAB + 31) // 32), dtype=torch.int32, generator=g)
    got = apply_token_mask(logits, TokenMask(rows, words))
    reference, full = logits.clone(), torch.full((4, words.shape[1]), -1, dtype=torch.int32)
    full[rows] = words  # xgrammar's rows of logits and bitmask are the same rows
    xgr.apply_token_bitmask_inplace(reference, full, indices=rows)
    assert torch.equal(got, reference)
    untouched = [i for i in range(4) if i not in rows]
    assert torch.equal(got[untouched], logits[untouched]) and not torch.equal(got[rows], logits[rows])


def test_sampler_applies_the_mask_after_penalties() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    allow_2_3 = torch.tensor([[0b1100]], dtype=torch.int32)
    rows = SamplerInputs(params, [(), (3,)], [0, 0], [(), ()], [None, None], TokenMask([1], allow_2_3))
    assert Sampler()(logits, rows).tolist() == [1, 2]  # row 1: token 3's logit halved by the penalty, 2 wins
    # min_tokens bans EOS (token 0) on both rows; row 1's constraint allows only EOS, so the constraint wins there.
    banned = [SamplingParams(temperature=0.0, min_tokens=3)] * 2
    only_eos = TokenMask([1], torch.tensor([[0b1]], dtype=torch.int32))
    rows = SamplerInputs(banned, [(), ()], [0, 0], [(0,), (0,)], [None, None], only_eos)
    assert Sampler()(torch.tensor([[9.0, 1.0, 0.0, 0.0], [9.0, 1.0, 0.0, 0.0]]), rows).tolist() == [1, 0]
    assert not Sampler.is_plain_argmax(SamplingParams(temperature=0.0, structured_outputs={"regex": "a"}), 0)


def test_bounded_strings_hold_no_raw_control_characters(tokenizer) -> None:
    # xgrammar 0.2.9's own grammar for a counted string admits U+0001 (invalid JSON); ours does not.
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3},
                                               "t": {"type": "string", "minLength": 1}}, "required": ["s", "t"]}
    engine = GrammarEngine(tokenizer, VOCAB, (tokenizer.eos_token_id,))
    compiled = engine.compile(Constraint(json=schema))
    assert not xgr.GrammarMatcher(compiled).accept_string('{"s": "\x01')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"s": "ab", "t": "\x1f')
    assert xgr.GrammarMatcher(compiled).accept_string('{"s": "a\x7fc", "t": "\u00e9x"}')
    raw = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))
    assert xgr.GrammarMatcher(raw.compile_json_schema(json.dumps(schema), any_whitespace=False)).accept_string(
        '{"s": "\x01')  # the bug this works around; when it is fixed, COUNTED_CHAR can go
    assert json.loads(choice_grammar(("a",)).split("::= ")[1]) == "a"
