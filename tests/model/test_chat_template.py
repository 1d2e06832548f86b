"""ChatTemplate: same text as transformers' renderer, sandbox escapes and runaway templates refused."""

from __future__ import annotations

import time

import pytest

from helexa.model.text.chat_template import ChatTemplate, ChatTemplateError, validate_messages

CHATML_WITH_TOOLS = """\
{%- if tools %}
<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}
# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
<|im_end|>
{% endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
  {%- if message.role == 'system' and tools %}{% continue %}{% endif %}
  {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{% if message.content is defined %}{{ message.content }}{% endif %}
{%- if message.tool_calls is defined %}
{%- for call in message.tool_calls %}
<tool_call>{{ call.function | tojson(indent=2, sort_keys=true) }}</tool_call>
{%- endfor %}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

PARTS_TEMPLATE = """\
{{ bos_token }}{% for message in messages %}[{{ message['role'] | upper }}]
{%- if message['content'] is string %}{{ message['content'] }}{% else %}
{%- for part in message['content'] %}{% if part['type'] == 'text' %}<t>{{ part['text'] }}</t>{% endif %}{% endfor %}
{%- endif %}{% generation %}{% endgeneration %}
{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token if not add_generation_prompt }}"""

MESSAGES = [
    {"role": "system", "content": "Be brief. Café ☕"},
    {"role": "user", "content": "What's the weather in 東京?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "東京", "unit": "C"}}}
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo <b>now</b>", "parameters": {}}}]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def _hf_render(source: str, messages: list, **kwargs) -> str:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered, _ = utils.render_jinja_template(conversations=[messages], chat_template=source, **SPECIAL, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_matches_transformers(add_generation_prompt: bool, tools) -> None:
    ours = ChatTemplate(CHATML_WITH_TOOLS, SPECIAL).render(
        MESSAGES, add_generation_prompt=add_generation_prompt, tools=tools
    )
    assert ours == _hf_render(CHATML_WITH_TOOLS, MESSAGES, tools=tools, add_generation_prompt=add_generation_prompt)
    assert "東京" in ours and "\\u" not in ours  # tojson keeps non-ASCII, as transformers' does
    if tools:
        assert "<b>now</b>" in ours  # and does not HTML-escape


def test_content_parts_passed_to_templates_that_loop_over_them() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "é"}]}]
    template = ChatTemplate(PARTS_TEMPLATE, SPECIAL)
    assert template.content_format == "parts"
    assert template.render(messages) == _hf_render(PARTS_TEMPLATE, messages, add_generation_prompt=True)
    assert template.render(messages) == "<s>[USER]<t>a</t><t>é</t>[ASSISTANT]"


def test_content_parts_flattened_for_string_templates() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    assert template.content_format == "string"
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert template.render([{"role": "user", "content": parts}, {"role": "user", "content": "x"}]) == "one\ntwo|x|"


def test_extra_kwargs_and_special_tokens_are_variables() -> None:
    template = ChatTemplate("{{ bos_token }}{{ enable_thinking }}{{ eos_token }}", SPECIAL)
    assert template.render([{"role": "user", "content": "x"}], enable_thinking=False) == "<s>False</s>"
    assert template.render([{"role": "user", "content": "x"}], bos_token="B", enable_thinking=1) == "B1</s>"


def test_strftime_now_and_generation_tag() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') }}{% generation %}g{% endgeneration %}")
    assert template.render([{"role": "user", "content": "x"}]) == time.strftime("%Y") + "g"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ messages.__class__.__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns._private = 1 %}",
    ],
)
def test_sandbox_escapes_are_errors(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "source, message",
    [
        ("{{ raise_exception('System role not supported') }}", "System role not supported"),
        ("{{ undefined_thing.attr }}", "undefined"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{{ messages[5]['content'] }}", "UndefinedError"),
        ("{% for x in range(10**7) %}{% endfor %}", "range"),
        ("{{ 'x' * 10**8 }}", "'\\*'"),
        ("{{ 7 ** 100000000 }}", "too large"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ],
)
def test_template_failures_are_chat_template_errors(source: str, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message) as info:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert isinstance(info.value, ValueError)


def test_runaway_template_is_stopped_by_the_deadline() -> None:
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="exceeded"):
        ChatTemplate(source, max_render_seconds=0.3).render([{"role": "user", "content": "x"}])
    assert time.monotonic() - start < 3


def test_output_size_is_capped() -> None:
    source = "{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="exceeds"):
        ChatTemplate(source, max_output_chars=10_000).render([{"role": "user", "content": "abcdefgh"}])


def test_compile_errors_at_construction() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% unknowntag %}")
    with pytest.raises(ChatTemplateError, match="non-empty"):
        ChatTemplate("")


def test_compiled_once_and_reused() -> None:
    template = ChatTemplate("{{ messages | length }}")
    compiled = template._template
    assert [template.render([{"role": "user", "content": "x"}] * n) for n in (1, 3)] == ["1", "3"]
    assert template._template is compiled


@pytest.mark.parametrize(
    "messages, problem",
    [
        ("hello", "list"),
        ([], "at least one"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "", "content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content is required"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\]\.content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"content\[0\]"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\]\.text"),
        ([{"role": "user", "content": "x", "meta": object()}], r"messages\[0\]\.meta"),
    ],
)
def test_message_validation(messages, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        validate_messages(messages)
    with pytest.raises(ValueError, match=problem):
        ChatTemplate("x").render(messages)


def test_validation_copies_and_drops_none() -> None:
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}}
    original = [{"role": "assistant", "content": None, "tool_calls": [call], "name": None}]
    copied = validate_messages(original)
    decoded = {**call, "function": {"name": "f", "arguments": {"x": [1]}}}  # JSON text -> object, for templates
    assert copied == [{"role": "assistant", "tool_calls": [decoded]}]
    copied[0]["tool_calls"][0]["id"] = "2"
    assert original[0]["tool_calls"][0]["id"] == "1" and original[0]["tool_calls"][0]["function"] == call["function"]
