"""Conversations with tools reach the chat template as transformers' `apply_chat_template(..., tools=)`
would render them (templates that handle tools), or in the parser's own format (templates that do not);
forced-call grammars accept exactly what the parsers read back."""

# ruff: noqa: E501 — the templates are data, written as the families write them

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from helexa.model.sampling.grammar import GrammarTokenizer
from helexa.model.text.chat_template import ChatTemplate, validate_messages
from helexa.model.text.tokenizer import Tokenizer
from helexa.model.tools import PARSERS, ToolSpecError, forced_call_grammar, parse_all, prepare_conversation, read_tools
from helexa.model.tools.parsers import HermesParser, Llama3JsonParser, MistralParser
from tests.support.models import build_tiny_tokenizer_dir

# Templates in the style of each family (written for these tests): each shows the tools, replays
# assistant tool calls (arguments as objects, through tojson) and tool results.
QWEN_STYLE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- elif message.role == 'assistant' %}
<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
<tool_call>
{"name": "{{ call.name }}", "arguments": {{ call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{% endif %}
{%- endif %}
{%- endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA31_STYLE = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

Environment: ipython
{% if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif %}<|eot_id|>
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>

Respond with {"name": function name, "parameters": arguments}. Functions:
{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ message.content | trim }}<|eot_id|>
{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_STYLE = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST]{{ message.content }}[/INST]
{%- elif message.tool_calls is defined %}[TOOL_CALLS][
{%- for tc in message.tool_calls %}
{%- if tc.id is not defined or tc.id | length != 9 %}{{ raise_exception('tool call ids must be 9 characters') }}{% endif %}
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}
{%- if not loop.last %}, {% endif %}
{%- endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"call_id": "{{ message.tool_call_id }}", "content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "東京"]}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]


def _conversation(call_id: str) -> list[dict]:
    """An agent loop as an OpenAI client sends it: arguments as JSON text, `content: null` beside tool calls."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}}
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in 東京?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 °C."},
        {"role": "user", "content": "And tomorrow?"},
    ]


def _as_transformers_documents(messages: list[dict]) -> list[dict]:
    """The same conversation as transformers' chat-template docs write it: arguments as objects, no null
    content."""
    out = copy.deepcopy(messages)
    for message in out:
        for call in message.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if message.get("content") is None:
            message.pop("content")
    return out


def _hf_render(source: str, messages: list, **kwargs) -> str:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = utils.render_jinja_template(conversations=[messages], chat_template=source, **SPECIAL, **kwargs)
    return rendered[0]


@pytest.mark.parametrize(
    "source, parser, call_id",
    [(QWEN_STYLE, HermesParser, "call_0"), (LLAMA31_STYLE, Llama3JsonParser, "call_0"), (MISTRAL_STYLE, MistralParser, "a1B2c3D4e")],
    ids=["qwen", "llama3.1", "mistral"],
)  # fmt: skip
@pytest.mark.parametrize("with_tools", [True, False])
def test_native_templates_render_as_transformers(source: str, parser, call_id: str, with_tools: bool) -> None:
    template = ChatTemplate(source, SPECIAL)
    assert template.uses_tools
    wire = _conversation(call_id)
    tools = read_tools(TOOLS) if with_tools else None
    messages, shown = prepare_conversation(validate_messages(wire), tools, template, parser)
    ours = template.render(messages, tools=shown)
    theirs = _hf_render(source, _as_transformers_documents(wire), tools=tools, add_generation_prompt=True)
    assert ours == theirs
    assert "東京" in ours and ("get_weather" in ours) and ('"temp": 21' in ours or "temp" in ours)


SMOL_STYLE = (  # a ChatML template with no notion of tools (as SmolLM2's)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser, MistralParser], ids=lambda p: p.name)
def test_templates_without_tools_get_them_in_the_parsers_format(parser) -> None:
    template = ChatTemplate(SMOL_STYLE)
    assert not template.uses_tools
    wire = _conversation("a1B2c3D4e")
    wire.insert(4, {"role": "tool", "tool_call_id": "x", "content": "second result"})
    messages, shown = prepare_conversation(validate_messages(wire), read_tools(TOOLS), template, parser)
    assert shown is None
    text = template.render(messages)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "get_weather"' in text
    assert parser.render_calls([("get_weather", {"city": "東京"})]) in text  # the call, as the model writes it
    # both tool results in one user turn, each in its block
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\nsecond result' in text
    assert "<|im_start|>tool" not in text
    # the conversation's own call text parses back to the call
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_all(parser(frozenset({"get_weather"})), turn)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "東京"})]


def test_null_content_beside_tool_calls_renders_with_a_template_that_concatenates_content() -> None:
    """The failure agent loops hit: `message['content']` concatenated when a turn has only tool calls."""
    template = ChatTemplate(SMOL_STYLE)
    text = template.render(validate_messages(_conversation("call_1")))
    assert "<|im_start|>assistant\n<|im_end|>" in text


def test_no_tools_and_no_tool_turns_pass_through() -> None:
    messages = validate_messages([{"role": "user", "content": "hi"}])
    assert prepare_conversation(messages, None, ChatTemplate(SMOL_STYLE), HermesParser) == (messages, None)


@pytest.fixture(scope="module")
def grammar_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, GrammarTokenizer]:
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer_dir(Path(tmp_path_factory.mktemp("tok"))))
    return tok, GrammarTokenizer(tok.backend.to_str(), tuple(sorted(tok.eos_token_ids)))


def _accepts(grammar_tok: GrammarTokenizer, tok: Tokenizer, grammar: str, text: str) -> bool:
    constraint = grammar_tok.constraint(grammar)
    matcher = constraint._matcher
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return bool(matcher.is_accepting())


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser, MistralParser], ids=lambda p: p.name)
def test_forced_grammar_accepts_calls_and_nothing_else(grammar_tokenizer, parser) -> None:
    tok, gtok = grammar_tokenizer
    tools = read_tools(TOOLS)
    one = forced_call_grammar(tools, parser, parallel=False)
    many = forced_call_grammar(tools, parser, parallel=True)
    named = forced_call_grammar(tools, parser, only="noop", parallel=False)
    compact = lambda calls: parser.render_calls(calls).replace('": ', '":').replace(", ", ",")  # noqa: E731
    if parser is not HermesParser:  # the separators between calls keep their space
        compact = lambda calls: parser.render_calls(calls).replace('": ', '":').replace(', "', ',"')  # noqa: E731
    weather, noop = ("get_weather", {"city": "Paris", "days": 2}), ("noop", {})
    assert _accepts(gtok, tok, one, compact([weather]))
    assert _accepts(gtok, tok, named, compact([noop]))
    assert not _accepts(gtok, tok, named, compact([weather]))
    assert _accepts(gtok, tok, many, compact([weather, noop]))
    assert not _accepts(gtok, tok, one, compact([weather, noop]))
    assert not _accepts(gtok, tok, one, compact([("get_weather", {"city": "Lyon"})]))  # not in the enum
    assert not _accepts(gtok, tok, one, compact([("get_weather", {"days": 2})]))  # required city missing
    assert not _accepts(gtok, tok, one, "Sure! " + compact([weather]))
    assert parse_all(PARSERS[parser.name](frozenset({"get_weather", "noop"})), compact([weather, noop]))[1]


def test_forcing_errors_name_the_param() -> None:
    tools = read_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}])
    with pytest.raises(ToolSpecError) as bad_schema:
        forced_call_grammar(tools, HermesParser)
    assert bad_schema.value.param == "tools[0].function.parameters"
    with pytest.raises(ToolSpecError) as unknown:
        forced_call_grammar(read_tools(TOOLS), HermesParser, only="nope")
    assert unknown.value.param == "tool_choice"


@pytest.mark.parametrize(
    "tools, param",
    [
        ({"name": "f"}, "tools"),
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
        ([{"type": "function", "name": "f"}, {"type": "function", "name": "f"}], "tools[1].name"),
    ],
)
def test_tool_declarations_are_checked(tools, param: str) -> None:
    with pytest.raises(ToolSpecError) as exc:
        read_tools(tools)
    assert exc.value.param == param


def test_responses_flat_tools_become_chat_shaped() -> None:
    flat = [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}]
    assert read_tools(flat) == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}}
    ]  # fmt: skip
