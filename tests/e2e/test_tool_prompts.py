"""Tools and tool-call history reach the prompt: as transformers renders them for a template that reads tools,
and in the Hermes convention for one that does not (the tiny Qwen2-VL's, like the real Qwen2-VL's)."""

from __future__ import annotations

import json

import pytest

from flashvlm import LLM, SamplingParams
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

# A Qwen2.5-style template that reads `tools`, assistant `tool_calls` and `tool` messages.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}\n\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' and tools %}{%- elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{%- for call in message.get('tool_calls', []) %}\n<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
               "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(str(build_qwen2_vl(tmp_path_factory.mktemp("qwen"), seed=5)), device="cpu", kv_cache_tokens=4096)


def test_a_tool_aware_template_renders_as_transformers_does(llm: LLM) -> None:
    ours = llm.engine.process_chat(HISTORY, chat_template=TOOL_TEMPLATE, tools=[WEATHER]).prompt_token_ids
    decoded = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if "tool_calls" in m else m for m in HISTORY]
    theirs = llm.engine.tokenizer.apply_chat_template(decoded, tools=[WEATHER], chat_template=TOOL_TEMPLATE,
                                                      tokenize=False, add_generation_prompt=True)
    assert ours == llm.engine.tokenizer.encode(theirs, add_special_tokens=False)
    text = llm.engine.tokenizer.decode(ours)
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_a_template_without_tools_gets_them_in_the_system_message(llm: LLM) -> None:
    text = llm.engine.tokenizer.decode(llm.engine.process_chat(HISTORY, tools=[WEATHER]).prompt_token_ids)
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    assert f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    plain = llm.engine.tokenizer.decode(llm.engine.process_chat(HISTORY[:1]).prompt_token_ids)
    assert "# Tools" not in plain


def test_chat_with_tools_generates(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with_tools = llm.chat(HISTORY, params, tools=[WEATHER])[0]
    without = llm.chat(HISTORY, params)[0]
    assert len(with_tools.token_ids) == 4
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids)
