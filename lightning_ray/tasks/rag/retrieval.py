"""Dense retrieval: all-MiniLM-L6-v2 sentence embeddings (models/embedder.py: from its PyPI package, mean-pooled and
L2-normalized as its own configs say) and cosine similarity in numpy.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

import numpy as np

from lightning_ray.models.embedder import Embedder

CACHE_DIR = Path("~/.cache/lightning_ray/rag").expanduser()  # embeddings of the generated corpora


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
