"""Tool calls in model text (parse, stream, tool_choice) and the tiny model's tool-aware chat template."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from lightning_ray.models.tiny import CHAT_TEMPLATE
from lightning_ray.serving.engines.grammar import check_json_schema
from lightning_ray.serving.tools import (ToolCallStreamParser, forced_call, forced_opening, parse_tool_calls,
                                         resolve_tool_choice, tool_call_format)

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}
MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}


def block(name, args) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def fn(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# --- parse_tool_calls ---------------------------------------------------------------------------------------------

def test_plain_text_is_unchanged():
    assert parse_tool_calls("  The answer is 5.\n") == ("  The answer is 5.\n", [])
    assert parse_tool_calls("") == (None, [])
    assert parse_tool_calls("a < b and <tool> is not a call") == ("a < b and <tool> is not a call", [])


def test_one_call_gives_openai_tool_call():
    content, calls = parse_tool_calls(block("add", {"a": 2, "b": 3}))
    assert content is None
    assert len(calls) == 1 and set(calls[0]) == {"id", "type", "function"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}


def test_several_calls_with_text_and_loose_whitespace():
    loose = '<tool_call>  {"name":"mul","arguments":{"x":[1,2]}}  </tool_call>\n'
    text = "Let me compute.\n\n" + block("add", {"a": 1}) + "\n" + loose
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert fn(calls) == [("add", {"a": 1}), ("mul", {"x": [1, 2]})]
    assert calls[0]["id"] != calls[1]["id"]


def test_string_arguments_are_kept_verbatim_and_parameters_is_accepted():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"q\\":  \\"x\\"}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"q":  "x"}'
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"q": 1}}</tool_call>')
    assert fn(calls) == [("f", {"q": 1})]
    _, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert calls[0]["function"]["arguments"] == "{}"


def test_non_ascii_arguments_stay_readable():
    _, calls = parse_tool_calls(block("say", {"text": "héllo ✓"}).replace("\\u00e9", "é"))
    assert json.loads(calls[0]["function"]["arguments"]) == {"text": "héllo ✓"}


@pytest.mark.parametrize("bad", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
    "<tool_call>[]</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',  # never closed (cut by max_tokens)
    "<tool_call>",
])
def test_malformed_blocks_stay_in_content(bad):
    text = "Before " + bad + " after"
    assert parse_tool_calls(text) == (text, [])


def test_malformed_block_next_to_a_good_one():
    content, calls = parse_tool_calls("<tool_call>oops</tool_call>\n" + block("add", {"a": 1}))
    assert content == "<tool_call>oops</tool_call>"
    assert fn(calls) == [("add", {"a": 1})]


def test_whitespace_is_tidied_only_around_calls():
    assert parse_tool_calls("Hi " + block("f", {}) + " there  ")[0] == "Hi there"
    assert parse_tool_calls(block("f", {}) + "\n\nDone.")[0] == "Done."
    assert parse_tool_calls("\n" + block("f", {}) + "\n" + block("g", {}) + "\n")[0] is None


def test_mistral_format_runs_to_the_end():
    content, calls = parse_tool_calls('ok [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]',
                                      "mistral")
    assert content == "ok" and fn(calls) == [("f", {"a": 1}), ("g", {})]
    assert parse_tool_calls("[TOOL_CALLS] not json", "mistral") == ("[TOOL_CALLS] not json", [])
    assert parse_tool_calls("end [TOOL_CALLS]", "mistral") == ("end [TOOL_CALLS]", [])


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError, match="unknown tool call format"):
        parse_tool_calls("x", "llama9")


# --- ToolCallStreamParser -----------------------------------------------------------------------------------------

def test_stream_sends_content_at_once_and_holds_a_possible_marker():
    p = ToolCallStreamParser()
    assert p.feed("Hello").content == "Hello"
    assert p.feed(" wor").content == " wor"
    held = p.feed("ld <tool")
    assert held.content == "ld" and held.tool_calls == []  # " <tool" may open a block
    assert p.feed("box>").content == " <toolbox>"  # it did not
    assert p.finish().content == ""


def test_stream_emits_a_call_when_its_block_closes():
    p = ToolCallStreamParser()
    assert p.feed("Sure.\n<tool_call>\n").content == "Sure."
    assert p.feed('{"name": "add", "arguments": {"a": 1}}\n</tool').tool_calls == []
    first = p.feed("_call>\n<tool_call>\n" + '{"name": "mul", "arguments": {}}\n</tool_call>')
    assert [c["index"] for c in first.tool_calls] == [0, 1]
    assert first.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert set(first.tool_calls[0]) == {"index", "id", "type", "function"}
    assert first.content == ""
    assert p.finish().content == ""


def test_stream_finish_flushes_partial_marker_and_unclosed_block():
    p = ToolCallStreamParser()
    assert p.feed("x <tool_c").content == "x"
    assert p.finish().content == " <tool_c"
    p = ToolCallStreamParser()
    p.feed('<tool_call>{"name": "f"')
    assert p.finish().content == '<tool_call>{"name": "f"'
    p = ToolCallStreamParser()
    assert p.feed("x <tool_call>").content == "x"
    assert p.finish().content == " <tool_call>"


TEXTS = [
    "plain answer, no tools\n",
    "Sure.\n" + block("add", {"a": 1, "b": [2, 3]}),
    block("add", {"a": 1}) + "\n" + block("mul", {"x": "y"}) + "\n",
    "Hi " + block("f", {}) + " there " + block("g", {"k": "<tool_call>"}) + "\nbye",
    "bad <tool_call>{oops}</tool_call> then " + block("f", {}) + " <tool_ca",
    "a<b<<tool_call>" + '{"name":"n","arguments":"{}"}' + "</tool_call>>",
    block("f", {}) + " ends open <tool_call>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_agrees_with_whole_text_parse_for_any_chunking(text):
    want_content, want_calls = parse_tool_calls(text)
    rng = random.Random(0)
    chunkings = [[text], list(text)] + [_random_chunks(text, rng) for _ in range(20)]
    for chunks in chunkings:
        p = ToolCallStreamParser()
        deltas = [p.feed(c) for c in chunks] + [p.finish()]
        calls = [c for d in deltas for c in d.tool_calls]
        assert "".join(d.content for d in deltas) == (want_content or "")
        assert fn(calls) == fn(want_calls)
        assert [c["index"] for c in calls] == list(range(len(calls)))


def _random_chunks(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "Sure. " + block("add", {"a": 1}) + "\n" + block("mul", {}) + " Done."),
    ("llama3_json", '[{"name": "add", "parameters": {"a": 1}}, {"name": "mul", "parameters": {}}]'),
])
def test_without_parallel_tool_calls_only_the_first_call_is_kept(fmt, text):
    """parallel_tool_calls: false: at most one call per turn (as vLLM keeps only the first); content as with all."""
    content, calls = parse_tool_calls(text, fmt, span_id="0123456789abcdef")  # the span: ids that compare equal
    assert fn(calls) == [("add", {"a": 1}), ("mul", {})]
    assert parse_tool_calls(text, fmt, span_id="0123456789abcdef", parallel=False) == (content, calls[:1])
    for chunks in ([text], list(text), _random_chunks(text, random.Random(1))):
        p = ToolCallStreamParser(fmt, parallel=False)
        deltas = [p.feed(c) for c in chunks] + [p.finish()]
        streamed = [c for d in deltas for c in d.tool_calls]
        assert fn(streamed) == [("add", {"a": 1})] and [c["index"] for c in streamed] == [0]
        assert "".join(d.content for d in deltas) == (content or "")


# --- resolve_tool_choice ------------------------------------------------------------------------------------------

def test_tool_choice_modes():
    assert resolve_tool_choice(None, [ADD, MUL]) == [ADD, MUL]
    assert resolve_tool_choice("auto", [ADD]) == [ADD]
    assert resolve_tool_choice("required", [ADD]) == [ADD]
    assert resolve_tool_choice("none", [ADD]) is None
    assert resolve_tool_choice(None, None) is None and resolve_tool_choice("auto", []) is None
    assert resolve_tool_choice({"type": "function", "function": {"name": "mul"}}, [ADD, MUL]) == [MUL]


@pytest.mark.parametrize("choice, tools, message", [
    ({"type": "function", "function": {"name": "sub"}}, [ADD, MUL],
     "tool_choice: function 'sub' is not in tools (add, mul)"),
    ({"type": "function", "function": {"name": "add"}}, None, "not in tools (none given)"),
    ("required", None, "tool_choice: 'required' needs at least one tool"),
    ("sometimes", [ADD], "expected 'none', 'auto', 'required'"),
    ({"type": "function", "name": "add"}, [ADD], "expected {'type': 'function', 'function'"),
    (7, [ADD], "expected {'type': 'function'"),
    ("auto", [{"type": "web_search"}], "tools[0]"),
    ("auto", ["add"], "tools[0]"),
])
def test_tool_choice_errors_are_clear(choice, tools, message):
    with pytest.raises(ValueError) as e:
        resolve_tool_choice(choice, tools)
    assert message in str(e.value)


# --- tool_choice enforced (forced_call) ------------------------------------------------------------------------

def test_forced_call_schema_allows_exactly_a_call_of_an_offered_tool():
    assert forced_call("auto", [ADD]) is None and forced_call("none", None) is None and forced_call(None, [ADD]) is None
    named = forced_call({"type": "function", "function": {"name": "add"}}, [ADD])
    assert named["properties"]["name"] == {"const": "add"}
    assert named["properties"]["arguments"] == ADD["function"]["parameters"]
    either = forced_call("required", [ADD, MUL])
    assert [branch["properties"]["name"]["const"] for branch in either["anyOf"]] == ["add", "mul"]
    check_json_schema(either)  # constrained decoding can enforce it (both engines compile it with xgrammar)
    no_parameters = {"type": "function", "function": {"name": "now"}}
    assert forced_call("required", [no_parameters])["properties"]["arguments"] == {"type": "object"}


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_forced_answer_is_the_call_itself_and_a_broken_one_its_text(chunks):
    """Under a forced call the server wrote the opening marker: the answer is the block's body, with no closing."""
    answer = '{"name":"add","arguments":{"a":2}}'
    for text, expected in ((answer, (None, [("add", {"a": 2})])), ('{"name":"add","argu', ('{"name":"add","argu', []))):
        parser = ToolCallStreamParser(forced=True)
        size = -(-len(text) // chunks)
        out = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
        content = "".join(d.content for d in out) or None
        assert (content, fn([c for d in out for c in d.tool_calls])) == expected
        assert parse_tool_calls(text, forced=True)[0] == expected[0]


# --- the tiny model's chat template -------------------------------------------------------------------------------

# The template before tool support, verbatim: the warmed-up tiny model was trained on exactly this rendering.
OLD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(template):
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def render():
    tok = _tokenizer(CHAT_TEMPLATE)
    return lambda messages, **kw: tok.apply_chat_template(messages, tokenize=False, **kw)


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "2*3"},
     {"role": "assistant", "content": "6"}, {"role": "user", "content": "and 2*4?\n  spaced {braces} <tags>"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\n"}],
    [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "ok"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": []}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_template_without_tools_renders_as_before(render, messages, add_generation_prompt):
    old = _tokenizer(OLD_TEMPLATE).apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)
    assert render(messages, add_generation_prompt=add_generation_prompt) == old
    assert render(messages, tools=[], add_generation_prompt=add_generation_prompt) == old


def test_template_lists_tools_in_a_system_block(render):
    text = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
                  tools=[ADD, MUL], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1  # the system message is merged, not repeated
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in listed] == [ADD, MUL]
    assert "<tool_call></tool_call> XML tags" in text
    assert text.endswith("<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_template_without_system_message_still_gets_a_tools_block(render):
    text = render([{"role": "user", "content": "hi"}], tools=[ADD])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")


def test_template_renders_tool_calls_and_tool_results(render):
    messages = [
        {"role": "user", "content": "2+3, then *4"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
            {"id": "c2", "type": "function", "function": {"name": "mul", "arguments": {"a": 5, "b": 4}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "Done.", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
    ]
    text = render(messages, tools=[ADD, MUL])
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n"
            "</tool_call>\n<tool_call>\n{\"name\": \"mul\", \"arguments\": {\"a\": 5, \"b\": 4}}\n</tool_call>"
            "<|im_end|>\n") in text
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text
    assert "<|im_start|>assistant\nDone.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>" in text
    assert "None" not in text


def test_rendered_tool_calls_parse_back(render):
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": "x y"}'}},
             {"id": "c2", "type": "function", "function": {"name": "mul", "arguments": "{}"}}]
    text = render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me see.",
                                                       "tool_calls": calls}], tools=[ADD, MUL])
    completion = text.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    content, parsed = parse_tool_calls(completion)
    assert content == "Let me see."
    assert [c["function"] for c in parsed] == [c["function"] for c in calls]


# --- Llama 3's JSON calls: no marker, the whole answer -------------------------------------------------------------

def test_llama3_json_answers_are_calls_and_other_text_is_content():
    call = '{"name": "add", "parameters": {"a": 2}}'
    assert fn(parse_tool_calls(call, "llama3_json")[1]) == [("add", {"a": 2})]
    assert fn(parse_tool_calls(f"\n {call}\n", "llama3_json")[1]) == [("add", {"a": 2})]
    assert fn(parse_tool_calls(f'[{call}, {{"name": "mul", "parameters": {{}}}}]', "llama3_json")[1]) == \
        [("add", {"a": 2}), ("mul", {})]
    for text in ("The set {1, 2} has two members.", '{"answer": 5}', "{not json", f"Calling: {call}"):
        assert parse_tool_calls(text, "llama3_json") == (text, [])  # a call only as the whole answer


@pytest.mark.parametrize("text", ['{"name": "Alice", "age": 30}', '[{"name": "Alice"}]'])
def test_llama3_json_answer_without_arguments_is_content_not_a_call(text):
    """With no marker, a JSON answer that has a "name" (a person, a product) is a call only with its arguments."""
    assert parse_tool_calls(text, "llama3_json") == (text, [])
    parser = ToolCallStreamParser("llama3_json")
    deltas = [parser.feed(text[:9]), parser.feed(text[9:]), parser.finish()]
    assert "".join(d.content for d in deltas) == text and not any(d.tool_calls for d in deltas)
    assert fn(parse_tool_calls('{"name": "now", "arguments": {}}', "llama3_json")[1]) == [("now", {})]
    assert fn(parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')[1]) == [("now", {})]  # a marker makes a call


def test_llama3_json_streamed_holds_a_leading_brace_until_the_end():
    parser = ToolCallStreamParser("llama3_json")
    deltas = [parser.feed(t) for t in (" ", '{"name": "add", ', '"parameters": {}}')] + [parser.finish()]
    assert [d.content for d in deltas] == ["", "", "", ""] and fn(deltas[-1].tool_calls) == [("add", {})]
    parser = ToolCallStreamParser("llama3_json")
    assert [parser.feed(t).content for t in ("It is", " {5}", ".")] == ["It is", " {5}", "."]  # content at once


def test_a_forced_llama3_call_opens_with_nothing_and_names_its_arguments_parameters():
    assert forced_opening("llama3_json") == "" and forced_opening() == "<tool_call>\n"
    schema = forced_call("required", [ADD], "llama3_json")
    assert schema["required"] == ["name", "parameters"] and "arguments" not in schema["properties"]


def test_the_format_is_the_one_the_chat_template_teaches():
    assert tool_call_format(CHAT_TEMPLATE) == "hermes"  # the tiny model's
    assert tool_call_format(None) == "hermes"
    assert tool_call_format('{"name": function name, "parameters": ...}<|start_header_id|>ipython') == "llama3_json"
    assert tool_call_format("{{ '[TOOL_CALLS]' }}") == "mistral"
