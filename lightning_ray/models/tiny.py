"""A tiny causal LM built locally (no hub): byte-level BPE, a ChatML chat template, 2 layers, hidden 64.

It is warmed up for a few seconds on correct calc transcripts, in two protocols: CALC lines in plain text, and
function calls through the chat template's tools (Hermes <tool_call> blocks). Sampled at temperature 1 it then
solves some tasks and fails others; that spread of rewards inside a GRPO group is what gives RL a signal.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from lightning_ray.tasks import calc

# ChatML; with `tools`, Hermes-style tool calling (as Qwen2.5 does). Without tools, tool calls or tool messages it
# renders exactly as before tools existed, which the warmed-up weights were trained on. transformers renders with
# trim_blocks, so a newline right after a block tag is written {{ '\n' }}.
CHAT_TEMPLATE = (
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
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_model(out_dir: str | Path, warmup_steps: int = 400, seed: int = 0) -> Path:
    """Write a tokenizer + model to out_dir (HF format) and return it."""
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(_corpus(400, seed=12345)), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    _warm_up(model, tokenizer, _corpus(2000, seed=seed + 1), warmup_steps, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _render(conv: list[dict], tools: list[dict] | None) -> str:
    rendered, _ = render_jinja_template([conv], tools=tools, chat_template=CHAT_TEMPLATE)
    return rendered[0]


def _corpus(n: int, seed: int) -> list[str]:
    """n calc transcripts in each protocol, rendered through the chat template."""
    tasks = calc.make_tasks(n, seed=seed)
    return ([_render(c, None) for c in calc.demonstrations(tasks)]
            + [_render(c, [calc.CALCULATOR_TOOL]) for c in calc.tool_demonstrations(tasks)])


def _train_bpe(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _warm_up(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, texts: list[str], steps: int,
             seed: int) -> None:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = tokenizer(rng.sample(texts, 16), return_tensors="pt", padding=True)
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
