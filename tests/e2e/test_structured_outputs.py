"""Structured outputs through LLM.generate on a tiny Qwen2-VL checkpoint (float32, CPU): every constrained output
parses and validates (random schemas, regex, choice, grammar), unconstrained neighbours get exactly the tokens they
get alone, the grammar stays in step with the tokens through chunked prefill, preemption, stop strings and aborts,
and log-probabilities stay the raw model's."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from flashvlm import LLM, SamplingParams
from flashvlm.request import InvalidRequestError
from flashvlm.structured.params import StructuredOutputsParams as Constraint
from flashvlm.testing.random_schemas import random_schemas
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen-structured"), seed=5)


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_tokens=16384, max_model_len=1024)


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)


def _prompts(n: int) -> list[dict]:
    return [{"prompt": IMG + f"Fill in form {i}.", "images": [_image(i)]} if i % 2 == 0 else
            {"prompt": f"Form number {i}:"} for i in range(n)]


def test_random_schemas_give_valid_json(llm: LLM) -> None:
    schemas = random_schemas(40, seed=1)
    # Greedy and seeded sampling rows alike, in one batch with images.
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs=Constraint(json=s)) for i, s in enumerate(schemas)]
    outs = llm.generate(_prompts(len(schemas)), params)
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert len(llm.engine.structured) == 0  # every matcher dropped with its request


def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    constraints = [Constraint(json_object=True), Constraint(regex=r"[A-Z]{2}-[0-9]{3}( ok)?"),
                   Constraint(choice=["yes", "no", 'say "maybe"\n']),
                   Constraint(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'),
                   Constraint(json='{"type": "array", "items": {"type": "boolean"}, "maxItems": 3}')]
    for temperature in (0.0, 1.0):
        outs = llm.generate(["Once upon a time"] * len(constraints),
                            [SamplingParams(temperature=temperature, seed=3, max_tokens=MAX_TOKENS,
                                            structured_outputs=c) for c in constraints])
        assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
        assert isinstance(json.loads(outs[0].text), dict)
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}( ok)?", outs[1].text)
        assert outs[2].text in ("yes", "no", 'say "maybe"\n')
        assert re.fullmatch(r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)", outs[3].text)
        value = json.loads(outs[4].text)
        assert isinstance(value, list) and len(value) <= 3 and all(isinstance(v, bool) for v in value)


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm: LLM) -> None:
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, top_k=30, seed=11, max_tokens=12, ignore_eos=True)]
    prompts = ["The quick brown fox", {"prompt": IMG + "Describe it.", "images": [_image(7)]}]
    alone = [o.token_ids for o in llm.generate(prompts, plain)]
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=Constraint(regex="[a-z]{5,20}"))
    mixed = llm.generate(["Hello", prompts[0], "World", prompts[1]], [constrained, plain[0], constrained, plain[1]])
    assert [mixed[1].token_ids, mixed[3].token_ids] == alone
    assert re.fullmatch("[a-z]{5,20}", mixed[0].text) and re.fullmatch("[a-z]{5,20}", mixed[2].text)


LONG = r"[a-z]{25,30}"


def test_grammar_survives_chunked_prefill_and_preemption(ckpt, llm: LLM) -> None:
    prompts = [f"Request number {i} asks for a long answer" for i in range(4)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=40,
                             structured_outputs=Constraint(regex=LONG)) for i in range(4)]
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    # Too little KV for the batch: requests are preempted and recomputed; chunks of 8 tokens split every prefill.
    small = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_tokens=128, block_size=16, max_model_len=128,
                max_num_batched_tokens=8)
    outs = small.generate(prompts, params)
    assert small.engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == reference
    assert all(re.fullmatch(LONG, o.text) for o in outs)


def test_logprobs_stay_the_raw_log_softmax(llm: LLM) -> None:
    runner = llm.engine.runner
    runner.record_logits = True
    try:
        [out] = llm.generate(["Once upon a time"], SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, structured_outputs=Constraint(choice=["zebra"])))
        rows = runner.recorded_logits[out.request_id]
    finally:
        runner.record_logits = False
        runner.recorded_logits.clear()
    assert out.text == "zebra"
    for entry, token, row in zip(out.logprobs, out.token_ids, rows, strict=True):
        reference = row.float().log_softmax(dim=-1)
        assert entry.token_id == token and abs(entry.logprob - reference[token].item()) <= 1e-5
        assert [t for t, _ in entry.top] == reference.topk(3).indices.tolist()


def test_stop_strings_abort_and_ignore_eos_end_the_matcher(llm: LLM) -> None:
    engine = llm.engine
    [cut] = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=60, stop=["c"],
                                                structured_outputs=Constraint(regex="abcabc")))
    assert cut.text == "ab" and cut.stop_reason == "c"
    # ignore_eos: the grammar's end (its stop token accepted) still ends the request, well before max_tokens.
    [ended] = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True,
                                                  structured_outputs=Constraint(choice=["done"])))
    assert ended.finish_reason == "stop" and ended.text == "done" and len(ended.token_ids) < 60
    req = engine.add_request("Hi", SamplingParams(temperature=0.0, max_tokens=60,
                                                  structured_outputs=Constraint(regex="[a-z]{50}")))
    engine.step()
    engine.step()
    assert len(engine.structured) == 1
    engine.abort_request(req.request_id)
    assert len(engine.structured) == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize(("constraint", "names"), [
    ({"json": {"type": "frobnicate"}}, "JSON schema"), ({"regex": "(ab"}, "regex"),
    ({"grammar": "root ::= missing_rule"}, "grammar"), ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
])
def test_a_bad_constraint_is_refused_before_anything_runs(llm: LLM, constraint: dict, names: str) -> None:
    good = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match=names):
        llm.generate(["a", "b"], [good, SamplingParams(max_tokens=4, structured_outputs=constraint)])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["a"], good)[0].token_ids) >= 1


def test_a_complete_constraint_wins_over_min_tokens(llm: LLM) -> None:
    # The choice is complete after its tokens and only EOS may follow, which min_tokens would ban: the constraint
    # wins (the request ends with its complete output) instead of leaving the row no token at all.
    [short, fine] = llm.generate(["Hi", "Hi"], [
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25, structured_outputs=Constraint(choice=["ok"])),
        SamplingParams(temperature=0.7, seed=1, max_tokens=30, min_tokens=25,
                       structured_outputs=Constraint(regex="[a-z]{26,28}"))])
    assert short.text == "ok" and short.finish_reason == "stop" and short.token_ids[-1] in llm.engine.eos_token_ids
    assert re.fullmatch("[a-z]{26,28}", fine.text) and fine.finish_reason == "stop"
    assert len(llm.engine.structured) == 0


def test_properties_come_in_the_schemas_order(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"enum": [1, 2]}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    [out] = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=40,
                                                structured_outputs=Constraint(json=schema)))
    assert list(json.loads(out.text)) == ["zeta", "alpha"]


def test_llava_family_with_an_image(tmp_path) -> None:
    from flashvlm.testing.tiny_checkpoints import build_llava

    llm = LLM(str(build_llava(tmp_path / "llava", seed=3)), device="cpu", dtype="float32")
    schemas = random_schemas(6, seed=8)
    prompts = [{"prompt": f"USER: <image>\nForm {i} ASSISTANT:", "images": [_image(i)]} for i in range(len(schemas))]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                 structured_outputs=Constraint(json=s)) for s in schemas])
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
