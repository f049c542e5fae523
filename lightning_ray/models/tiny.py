"""A tiny causal LM built locally (no hub): byte-level BPE, a ChatML chat template, 2 layers, hidden 64.

It is warmed up (`warmup_steps` AdamW steps of 16 transcripts, 1,000 by default) on correct calc transcripts, in
two protocols: CALC lines in plain text, and function calls through the chat template's tools (Hermes <tool_call>
blocks). Sampled at temperature 1 it then solves some tasks and fails others; that spread of rewards inside a GRPO
group is what gives RL a signal.

The warm-up runs on one thread, so a host builds the same model whatever its load and core count (a thread count's
reduction order is its own numerics), and checks where it ended: at a constant rate the last step can fall in a loss
spike. Measured on one 2-core Intel host (2026-12-05): five builds wrote the correct transcript with probability
0.16-0.19 at temperature 1.5 (1 and 2 threads, seeds 0-3), one built on 2 threads beside a fresh clone's tests 0.05,
which the tests' four-iteration learning run could not lift; 200 steps more took it to 0.23. A build below QUALITY_FLOOR
on the probe problems goes on, 50 steps at a time, until it is above.
"""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from lightning_ray.learner.scoring import actions_forward
from lightning_ray.serving.templates import HERMES_CHATML as CHAT_TEMPLATE
from lightning_ray.tasks import calc

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Sums and differences of two small numbers ("Calculate 45 - 7."): what the tests' tasks draw.
EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
        "allow_parentheses": False, "allow_negation": False}
# The mean probability of writing a probe problem's correct transcript at temperature 1.5 a build must reach.
QUALITY_FLOOR, PROBE_TEMPERATURE = 0.1, 1.5


def build_tiny_model(out_dir: str | Path, warmup_steps: int = 1000, seed: int = 0) -> Path:
    """Write a tokenizer + model to out_dir (HF format) and return it."""
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(  # positions for the tests' longest contexts (the sql and rag agents': 2,048)
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    with _one_thread():
        _warm_up(model, tokenizer, _corpus(2000, seed=seed + 1), warmup_steps, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The model's tokenizer alone (seconds, where the model takes minutes): byte-level BPE fitted to calc
    transcripts, with the ChatML chat template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(_corpus(400, seed=12345)), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _render(conv: list[dict], tools: list[dict] | None) -> str:
    rendered, _ = render_jinja_template([conv], tools=tools, chat_template=CHAT_TEMPLATE)
    return rendered[0]


def _corpus(n: int, seed: int) -> list[str]:
    """n calc transcripts of each protocol (text, tools), rendered through the chat template, as the calc agent
    opens them (with its worked example) and as a plain chat would (system prompt, question): the tests also drive
    the tiny model through agent frameworks with their own prompts. Seeds from 100000 up: reasoning-gym seeds item
    i with seed + i, so these stay clear of the small seeds training and evaluation use."""
    tasks = calc.make_tasks(n, seed=100_000 + seed, options=EASY)
    text, tools = calc.demonstrations(tasks), calc.tool_demonstrations(tasks)
    example = len(calc.opening({"dataset": "basic_arithmetic", "protocol": "text"})) - 1  # turns after the system's
    return ([_render(c, None) for c in text] + [_render(c, [calc.CALCULATOR_TOOL]) for c in tools]
            + [_render(c[:1] + c[1 + example:], None) for c in text]
            + [_render(c[:1] + c[1 + example:], [calc.CALCULATOR_TOOL]) for c in tools])


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
             seed: int, floor: float = QUALITY_FLOOR, max_extra_steps: int = 1000) -> int:
    """`steps` steps, then 50 at a time (the same optimizer and data stream) while the model is below `floor` on the
    probe problems, up to `max_extra_steps`. Returns the steps taken."""
    rng = random.Random(seed)
    encoded = [torch.tensor(ids) for ids in tokenizer(texts).input_ids]  # once, not per batch (~10% of a step)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    probe = calc.make_tasks(64, seed=200_000 + seed, options=EASY)  # clear of training's, evaluation's and texts'
    for extra in range(0, max_extra_steps + 1, 50):
        model.train()
        for _ in range(steps if extra == 0 else 50):
            sample = rng.sample(encoded, 16)
            input_ids = pad_sequence(sample, batch_first=True, padding_value=tokenizer.pad_token_id)
            real = pad_sequence([torch.ones(len(ids), dtype=torch.bool) for ids in sample], batch_first=True)
            loss = next_token_loss(model, input_ids, real[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        quality = sum(correct_probabilities(model, tokenizer, probe, PROBE_TEMPERATURE)) / len(probe)
        if quality >= floor or extra + 50 > max_extra_steps:
            return steps + extra


def correct_probabilities(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, tasks: list,
                          temperature: float) -> list[float]:
    """Per calc task, P(the model writes its correct CALC turn and its correct ANSWER turn) at `temperature`, each
    turn ending with the end-of-turn token, given the conversation before it as the agent sends it (text protocol).
    Teacher-forced: no sampling noise."""
    def ids(conversation: list[dict], generation_prompt: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    out = []
    for transcript in calc.demonstrations(tasks):  # ..., question, CALC turn, RESULT, ANSWER turn
        total = 0.0
        for turn in (len(transcript) - 3, len(transcript) - 1):
            prompt, full = ids(transcript[:turn], generation_prompt=True), ids(transcript[:turn + 1])
            assert full[:len(prompt)] == prompt
            end = full.index(tokenizer.eos_token_id, len(prompt)) + 1
            tokens = torch.tensor(full[:end])
            with torch.no_grad():
                logits = model(tokens[None]).logits[0, :-1].float() / temperature
            logprobs = torch.log_softmax(logits, -1).gather(1, tokens[1:, None])[:, 0]
            total += logprobs[len(prompt) - 1:].sum().item()
        out.append(math.exp(total))
    return out


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def next_token_loss(model: LlamaForCausalLM, input_ids: torch.Tensor, predicts: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the tokens `predicts` marks (position i predicts token i + 1) in right-padded rows,
    scored as the learner scores actions (`actions_forward`: no attention mask, the LM head on those positions only):
    the same loss as the model's own with a mask and -100 labels (test_learner_math.py), a step in ~0.65 of the time
    (the build 165 -> 134 s here)."""
    _, logits = actions_forward(model, input_ids, predicts)
    return torch.nn.functional.cross_entropy(logits, input_ids[:, 1:][predicts])
