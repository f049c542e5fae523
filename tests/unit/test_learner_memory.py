"""The learner's memory check before DeepSpeed starts (learner/memory.py): ZeRO's arithmetic for mixed-precision Adam,
18 bytes a trained parameter (bf16 weights 2, fp32 gradients 4, fp32 master weights 4, Adam's moments 8), against the
presets and placements on an 80 GB GPU. On CPUs the check stands aside (host memory is the operating system's)."""

from __future__ import annotations

import pytest
import torch

from lightning_ray.learner.memory import check_fits, model_state_bytes

H100 = 80e9


@pytest.mark.parametrize("params, ranks, stage, engine_share, fits", [
    (7.6e9, 1, 1, 0.0, False),  # Qwen2.5-7B, placement=split: 137 GB
    (7.6e9, 4, 3, 0.0, True),  # ... placement=eight_gpus: 34 GB a rank
    (3.2e9, 1, 1, 0.35, False),  # Llama-3.2-3B colocated: 58 GB beside the engine's 28
    (1.5e9, 1, 1, 0.35, True),  # Qwen2.5-1.5B colocated: 27 GB
])
def test_the_model_states_of_the_presets_on_an_80_gb_gpu(params, ranks, stage, engine_share, fits):
    need = model_state_bytes(int(params), 0, 2, ranks, stage, offload=False, reference=False)
    assert need == pytest.approx(18 * params / (ranks if stage == 3 else 1))
    assert (need <= H100 * (1 - engine_share)) == fits


def test_zero_offload_lora_and_a_reference_each_move_the_bound_as_they_should():
    full = model_state_bytes(10**9, 0, 2, 4, 2, offload=False, reference=False)
    assert full == 2e9 + 16e9 / 4  # stage 2: gradients and optimizer state partitioned, weights whole
    assert model_state_bytes(10**9, 0, 2, 4, 2, offload=True, reference=False) == 2e9 + 4e9 / 4
    assert model_state_bytes(10**9, 0, 2, 4, 2, offload=False, reference=True) == full + 2e9
    lora = model_state_bytes(10**7, 10**9, 2, 1, 1, offload=False, reference=False)
    assert lora == 2 * (10**9 + 10**7) + 18 * 10**7 - 2 * 10**7  # the frozen base: its bf16 weights alone
    assert model_state_bytes(10**9, 0, 4, 1, 0, offload=False, reference=False) == 16e9  # fp32: no master copy


def test_on_cpus_the_check_stands_aside():  # it would ask CUDA for its free memory
    check_fits(torch.nn.Linear(4, 4), torch.device("cpu"), 1, 0, offload=False, reference=False)


def test_on_a_gpu_too_small_the_check_names_the_settings_that_fit(monkeypatch):
    """No GPU here: CUDA's free-memory query stands in, as a GPU with a 1 MB or a 1 TB free would answer it."""
    model = torch.nn.Linear(256, 256).to(torch.bfloat16)  # 65,792 parameters: 1.2 MB of model states
    for free, fits in ((1e6, False), (1e12, True)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (int(free), int(80e9)))
        if fits:
            check_fits(model, torch.device("cuda"), 1, 1, offload=False, reference=False)
        else:
            with pytest.raises(MemoryError, match=r"at least 0\.0 GiB.*learner\.zero_stage=1.*"
                                                  r"learner\.offload_optimizer=true.*learner\.lora"):
                check_fits(model, torch.device("cuda"), 1, 1, offload=False, reference=False)


def test_a_rank_out_of_gpu_memory_tells_the_driver_which_settings_lower_it(monkeypatch):
    """(The same batch would run out again on a restart or a resume.) A CUDA out-of-memory error cannot be produced
    on CPUs: the rank's work raises torch's, as a step that ran out would."""
    from types import SimpleNamespace

    import ray.train

    from lightning_ray.learner import worker

    def out_of_memory(cfg, nonce):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB")

    monkeypatch.setattr(worker, "learn", out_of_memory)
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_world_rank=lambda: 0))
    posted = []
    with pytest.raises(torch.OutOfMemoryError):
        worker.train_loop_per_worker({"outbox": SimpleNamespace(put=posted.append)})
    [message] = posted
    assert "Tried to allocate" in message["error"] and "learner.micro_batch_tokens" in message["error"]
