"""The unit tier starts nothing: a test here that asks for the Ray cluster (directly or through another fixture) or
starts Ray itself fails, and belongs in tests/integration/."""

from __future__ import annotations

import pytest
import ray
import torch
import torch.distributed as dist
from helpers import free_port
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lightning_ray.models.tiny import build_tokenizer


@pytest.fixture(scope="session")
def ray_cluster():
    pytest.fail("a unit test asked for the Ray cluster: move it to tests/integration/")


@pytest.fixture(autouse=True)
def starts_no_ray():
    running = ray.is_initialized()  # in `make test`, the integration tests' session cluster may be up already
    yield
    assert running or not ray.is_initialized(), "a unit test started Ray: move it to tests/integration/"


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The tiny model's tokenizer alone, saved and loaded as the model's directory holds it: seconds, where the
    model's build takes minutes on a fresh machine (what the tests here need of it is its tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer().save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def small_model(tokenizer, tmp_path_factory) -> str:
    """A small random Llama with the tiny model's tokenizer and positions (512), for an engine to serve: seconds to
    build, where the tiny model's warm-up takes minutes."""
    path = tmp_path_factory.mktemp("small-model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def one_rank():
    """A process group of one rank in this process, as Ray Train gives each worker: DeepSpeed needs one (one for
    the session: DeepSpeed keeps the first it is given)."""
    with pytest.MonkeyPatch.context() as env:
        for k, v in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
            env.setenv(k, v)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
        yield
        dist.destroy_process_group()
