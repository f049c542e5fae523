"""The tiny test model's warm-up (models/tiny.py) checks where it ended: a build below the quality floor on the probe
problems trains on, 50 steps at a time, up to a cap; one above it stops at once."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ray.models import tiny


def small_model(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                        max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id))


def test_a_warm_up_ending_below_the_floor_trains_on_until_above_it_or_the_cap(tokenizer):
    texts = tiny._corpus(8, seed=1)
    assert tiny._warm_up(small_model(tokenizer), tokenizer, texts, steps=3, seed=0, floor=0.0) == 3
    assert tiny._warm_up(small_model(tokenizer), tokenizer, texts, steps=3, seed=0, floor=1.01,
                         max_extra_steps=60) == 53  # a probability never reaches 1.01; no 50 more past 60


def test_the_probability_of_a_correct_transcript_is_the_product_of_its_turns_tokens(tokenizer):
    """Teacher-forced, no sampling: the same model and tasks give the same numbers, each a probability (an untrained
    model's far below one in a million: two turns of tens of tokens each)."""
    model, tasks = small_model(tokenizer).eval(), tiny.calc.make_tasks(4, seed=3, options=tiny.EASY)
    at_1 = tiny.correct_probabilities(model, tokenizer, tasks, 1.0)
    assert at_1 == tiny.correct_probabilities(model, tokenizer, tasks, 1.0)
    assert all(0 < p < 1e-6 for p in at_1)
