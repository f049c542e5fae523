"""A tiny causal LM built locally (no hub): byte-level BPE, a ChatML chat template, 2 layers, hidden 64.

It is warmed up for a few seconds on correct calc transcripts (reasoning-gym's basic_arithmetic), in two protocols:
CALC lines in plain text, and function calls through the chat template's tools (Hermes <tool_call> blocks). Sampled
at temperature 1 it then solves some tasks and fails others; that spread of rewards inside a GRPO group is what
gives RL a signal.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from lightning_ray.serving.templates import HERMES_CHATML as CHAT_TEMPLATE
from lightning_ray.tasks import calc

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Mostly the easiest problems (two one-digit terms), some of the task's default ones (up to three two-digit terms).
EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
WARMUP_STEPS, BATCH, LR = 400, 16, 3e-3


def build_tiny_model(out_dir: str | Path, warmup_steps: int = WARMUP_STEPS, seed: int = 0) -> Path:
    """Write a tokenizer + model to out_dir (HF format) and return it."""
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(sum(_corpus(400, seed=12345), [])), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", bos_token=None,
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


def _corpus(n: int, seed: int) -> tuple[list[str], ...]:
    """n calc transcripts of each protocol (text, tools), rendered through the chat template, as the calc agent
    opens them (with its worked example) and as a plain chat would (system prompt, question): the tests drive the
    tiny model through agent frameworks with their own prompts. Seeds from 100000 up: reasoning-gym seeds item i
    with seed + i, so these stay clear of the small seeds training and evaluation use."""
    tasks = (calc.make_tasks(n - n // 4, seed=100_000 + seed, options=EASY)
             + calc.make_tasks(n // 4, seed=200_000 + seed))
    text, tools = calc.demonstrations(tasks), calc.tool_demonstrations(tasks)
    example = len(calc.opening({"dataset": "basic_arithmetic", "protocol": "text"})) - 1  # turns after the system's
    plain = [c[:1] + c[1 + example:] for c in text], [c[:1] + c[1 + example:] for c in tools]
    return ([_render(c, None) for c in text], [_render(c, [calc.CALCULATOR_TOOL]) for c in tools],
            [_render(c, None) for c in plain[0]], [_render(c, [calc.CALCULATOR_TOOL]) for c in plain[1]])


def _train_bpe(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # One token per digit and per symbol: an expression or a number is then the same tokens wherever it stands
    # (in the question, in a tool call's JSON string, after RESULT), so copying it is one skill, learned once.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[^\w\s]"), behavior="isolated"), pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def _assistant_mask(texts: list[str], offsets: torch.Tensor) -> torch.Tensor:
    """True for the tokens of the assistant's turns: the loss goes to what the policy writes (copying expressions
    and results), not to the long, fixed prompts around it, which a model this small would learn at its expense."""
    mask = torch.zeros(offsets.shape[:2], dtype=torch.bool)
    for i, text in enumerate(texts):
        for m in _ASSISTANT.finditer(text):
            mask[i] |= (offsets[i, :, 0] >= m.start(1)) & (offsets[i, :, 1] <= m.end(1)) & (offsets[i, :, 1] > 0)
    return mask


def _warm_up(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, corpora: tuple[list[str], ...],
             steps: int, seed: int) -> None:
    """Next-token loss on the assistant's tokens. A batch is one protocol's: its transcripts share their opening
    turns (with the tools listed, most of a tool transcript), which are run once and their KV cache reused, and logits
    are computed only where there is a label. That makes a step cheap enough for the copying skills to form in
    seconds."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    for step in range(steps):
        texts = rng.sample(corpora[step % len(corpora)], BATCH)
        # the turns all share (system, worked example), up to a special token: it tokenizes the same on its own
        cut = os.path.commonprefix(texts).rfind("<|im_start|>")
        prefix = tokenizer(texts[0][:cut], return_tensors="pt").input_ids
        cache = model.model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(BATCH)
        suffixes = [t[cut:] for t in texts]
        batch = tokenizer(suffixes, return_tensors="pt", padding=True, return_offsets_mapping=True)
        target = _assistant_mask(suffixes, batch.pop("offset_mapping"))[:, 1:]  # token t+1 is predicted at t
        mask = torch.cat([torch.ones(BATCH, prefix.shape[1], dtype=torch.long), batch.attention_mask], dim=1)
        hidden = model.model(input_ids=batch.input_ids, attention_mask=mask, past_key_values=cache).last_hidden_state
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[:, :-1][target]), batch.input_ids[:, 1:][target])
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
