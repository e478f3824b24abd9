"""Our chat-template rendering equals transformers' apply_chat_template for the same template and messages."""

from __future__ import annotations

import json

import pytest

from services.router.chat_template import ChatTemplate, ChatTemplateError
from tests.conftest import TINY_CODE

TINY = TINY_CODE
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich <old town>", "days": 3, "units": ["c"]}}}
CHATS = {
    "plain": [{"role": "user", "content": "hi"}],
    "system_and_parts": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    "tool_loop": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "Let me look.", "reasoning_content": " I need the tool. ",
                   "tool_calls": [CALL, {**CALL, "id": "call_2", "function": {"name": "noop", "arguments": {}}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21°C"},
                  {"role": "tool", "tool_call_id": "call_2", "content": "ok"}],
    "multi_turn": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1", "reasoning": "old"},
                   {"role": "user", "content": "two"}, {"role": "assistant", "content": "2", "thinking": "new"},
                   {"role": "user", "content": "three"}],
}

# a second template exercising what transformers' environment adds: loop controls, namespace,
# raise_exception, tojson's arguments, documents, special tokens and trim/lstrip of block tags
FEATURES = """{{ bos_token or '' }}{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'bogus' %}{{ raise_exception('bad role') }}{% endif %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
    {% if m.content == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ m.role }}] {{ m.content | tojson }} {{ m | tojson(indent=2, sort_keys=True) }}
{% endfor %}
{% if tools %}{{ tools | tojson(separators=(',', ':'), ensure_ascii=True) }}{% endif %}
{% for d in documents or [] %}<doc title="{{ d.title }}">{{ d.text }}</doc>{% endfor %}
count={{ ns.n }}{{ eos_token }}{% if add_generation_prompt %}>>{% endif %}"""


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(TINY / "tokenizer.json"),
                                                eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def _hf(tok, source, messages, **kw):
    return tok.apply_chat_template(messages, chat_template=source, tokenize=False, **kw)


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_tiny_code_template_matches_transformers(hf_tokenizer, chat, thinking, with_tools):
    ours = ChatTemplate.load(TINY)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    tools = TOOLS if with_tools else None
    for gen in (True, False):
        want = _hf(hf_tokenizer, ours.sources["default"], CHATS[chat], tools=tools, add_generation_prompt=gen,
                   **kwargs)
        assert ours.render(CHATS[chat], tools=tools, add_generation_prompt=gen, template_kwargs=kwargs) == want


def test_tiny_code_template_shape():
    t = ChatTemplate.load(TINY)
    on = t.render(CHATS["tool_loop"], tools=TOOLS)
    assert on.startswith("[gMASK]<sop><|system|>") and on.endswith("<|assistant|><think>")
    assert ("<|assistant|><think>I need the tool.</think>Let me look.<tool_call>get_weather<arg_key>city</arg_key>"
            "<arg_value>Zürich <old town></arg_value><arg_key>days</arg_key><arg_value>3</arg_value>") in on
    assert "<|observation|><tool_response>sunny, 21°C</tool_response><tool_response>ok</tool_response>" in on
    assert json.dumps(TOOLS[0], ensure_ascii=False) in on
    off = t.render(CHATS["multi_turn"], template_kwargs={"enable_thinking": False})
    assert off.endswith("<|user|>three<|assistant|></think>") and "old" not in off and "new" not in off


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_environment_features_match_transformers(hf_tokenizer, chat):
    docs = [{"title": "a", "text": "first"}, {"title": "b", "text": "second"}]
    msgs = CHATS[chat] + [{"role": "user", "content": "skip"}]
    ours = ChatTemplate(FEATURES, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    for tools, gen in ((None, True), (TOOLS, False)):
        want = _hf(hf_tokenizer, FEATURES, msgs, tools=tools, documents=docs, add_generation_prompt=gen)
        assert ours.render(msgs, tools=tools, documents=docs, add_generation_prompt=gen) == want


def test_raise_exception_and_reserved_kwargs():
    ours = ChatTemplate(FEATURES)
    with pytest.raises(ChatTemplateError, match="bad role"):
        ours.render([{"role": "bogus", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="messages"):
        ours.render([{"role": "user", "content": "x"}], template_kwargs={"messages": []})


def test_sources(tmp_path):
    assert ChatTemplate.load(tmp_path) is None  # no template anywhere: no made-up one
    assert ChatTemplate("{% generation %}x{% endgeneration %}").render([]) == "x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "</s>"}, "chat_template": [{"name": "default", "template": "D{{ eos_token }}"},
                                                             {"name": "tool_use", "template": "T"}]}))
    t = ChatTemplate.load(tmp_path)
    assert t.render([]) == "D</s>" and t.render([], tools=TOOLS) == "T"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.load(tmp_path).render([]) == "J"
    override = tmp_path / "mine.jinja"
    override.write_text("M{{ messages | length }}")
    assert ChatTemplate.load(tmp_path, override).render([{"role": "user", "content": ""}]) == "M1"
    with pytest.raises(FileNotFoundError):
        ChatTemplate.load(tmp_path, tmp_path / "missing.jinja")
