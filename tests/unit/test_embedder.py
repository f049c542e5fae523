"""Sentence embeddings as a sentence-transformers directory's own configs say (models/embedder.py): all-MiniLM-L6-v2
from its package, mean-pooled and normalized, cut at its max_seq_length; CLS pooling where a model asks for it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_ray.models.embedder import Embedder, packaged_minilm


@pytest.fixture(scope="module")
def minilm():
    return Embedder()


def test_minilm_gives_unit_vectors_and_counts_the_tokens_it_read(minilm):
    texts = ["a cat sat on the mat", "the quarks of quantum chromodynamics " * 100]
    vectors, tokens = minilm.encode(texts)
    assert vectors.shape == (2, 384) and minilm.pooling == "mean" and minilm.normalize
    assert np.linalg.norm(vectors, axis=1) == pytest.approx(1, abs=1e-5)
    assert tokens == len(minilm.tokenizer(texts[0])["input_ids"]) + 256  # the long one cut at max_seq_length
    assert np.allclose(minilm([texts[0]]), vectors[:1], atol=1e-6)  # batched or alone, the same


def test_cls_pooling_where_the_model_asks_for_it_and_a_clear_error_for_other_poolings(tmp_path, minilm):
    source = packaged_minilm()
    for f in source.iterdir():
        if f.is_file():
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    text = "a cat sat on the mat"
    with torch.no_grad():
        hidden = minilm.model(**minilm.tokenizer([text], return_tensors="pt")).last_hidden_state
    expected = torch.nn.functional.normalize(hidden[:, 0], dim=-1).numpy()
    assert np.allclose(Embedder(tmp_path)([text]), expected, atol=1e-6)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling .* is not supported"):
        Embedder(tmp_path)
