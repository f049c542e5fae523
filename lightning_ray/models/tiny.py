"""A tiny causal LM built locally (no hub): byte-level BPE, a ChatML chat template, 2 layers, hidden 64.

It is warmed up for a few seconds on correct calc transcripts so that, sampled at temperature 1, it solves some
tasks and fails others. That spread of rewards inside a GRPO group is what gives RL a signal to learn from.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lightning_ray.tasks import calc

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_model(out_dir: str | Path, warmup_steps: int = 300, seed: int = 0) -> Path:
    """Write a tokenizer + model to out_dir (HF format) and return it."""
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(), eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    _warm_up(model, tokenizer, warmup_steps, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _corpus() -> list[str]:
    texts = []
    for conv in calc.demonstrations(calc.make_tasks(400, seed=12345)):
        texts.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv))
    return texts


def _train_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _warm_up(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int, seed: int) -> None:
    rng = random.Random(seed)
    convs = calc.demonstrations(calc.make_tasks(2000, seed=seed + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in rng.sample(convs, 16)]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
