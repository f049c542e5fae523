"""Chat templates the server can render with instead of the model's own (`serve.chat_template`).

A model whose own template ignores `tools` (SmolLM2-135M-Instruct's does) never sees the tool schemas. If it speaks
ChatML (<|im_start|> ... <|im_end|>), HERMES_CHATML renders the tools as Hermes/Qwen2.5 do, in the format that the
server's Hermes tool-call parser (serving/tools.py) reads back out of the completion.
"""

from __future__ import annotations

from pathlib import Path

# ChatML; with `tools`, Hermes-style tool calling (as Qwen2.5 does). Without tools, tool calls or tool messages it
# renders plain ChatML, exactly as before tools existed. transformers renders with trim_blocks, so a newline right
# after a block tag is written {{ '\n' }}.
HERMES_CHATML = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
    " XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"  # already merged into the tools block
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}\n{% endif %}"
    "{% for tc in m['tool_calls'] %}{% set f = tc['function'] if tc['function'] is defined else tc %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": {{ f['name'] | tojson }}, \"arguments\": "
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {"hermes": HERMES_CHATML}


def resolve_chat_template(value: str | None) -> str | None:
    """`serve.chat_template` as template text: None keeps the model's own, a name in TEMPLATES is ours, anything
    else is the path of a Jinja file."""
    if value is None:
        return None
    if value in TEMPLATES:
        return TEMPLATES[value]
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"serve.chat_template={value}: no such file (expected {' or '.join(TEMPLATES)} or "
                                f"the path of a Jinja chat template)")
    return path.read_text()
