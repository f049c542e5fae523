"""The learner's scoring, gradient accumulation and steps, on a small random Llama in one process (no Ray needed;
the steps through a real DeepSpeed engine on a one-rank process group)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig,
                          LlamaForCausalLM)

from lightning_ray.algorithm.lightningrl import merge_calls
from lightning_ray.algorithm.loss import policy_loss, token_weights
from lightning_ray.config import AlgorithmConfig, LearnerConfig, LoraConfig
from lightning_ray.learner.driver import batch_plan, micro_batches
from lightning_ray.learner.digest import _bits_checksum, parameter_digest
from lightning_ray.learner.scoring import WithValueHead, collate, score, shared_prefix
from lightning_ray.learner.worker import deepspeed_engine, load_state, save_state, train_step
from lightning_ray.models.tiny import next_token_loss
from lightning_ray.types import Transition

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, pad_token_id=0)


def fresh() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).float()


@pytest.fixture(scope="module")
def model():
    return fresh()


def batch_of(n: int, seed: int = 0) -> list[Transition]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(3, 30), rng.randint(1, 12)
        out.append(Transition(rollout_id=f"r{i}", group_id="g", span_id=f"s{i}",
                              prompt_ids=[rng.randrange(1, 97) for _ in range(p)],
                              response_ids=[rng.randrange(1, 97) for _ in range(r)], logprobs=[-1.0] * r,
                              reward=1.0, advantage=rng.choice([-1.0, 0.5, 2.0]), policy_version=0,
                              temperature=rng.choice([0.7, 1.0])))
    return out


def test_score_is_the_tempered_softmax_of_the_full_forward_pass(model):
    transitions = batch_of(6)
    batch = collate([(t, 1.0) for t in transitions], pad_id=0)
    tempered, entropy, _ = score(model, batch)
    expected_t, expected_h = [], []
    with torch.no_grad():
        for t in transitions:  # one unpadded row at a time, the whole vocabulary, the textbook way
            ids = torch.tensor([[*t.prompt_ids, *t.response_ids]], dtype=torch.long)
            logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1]
            target = torch.from_numpy(t.response_ids).long()[:, None]
            expected_t += torch.log_softmax(logits / t.temperature, -1).gather(-1, target).squeeze(-1).tolist()
            expected_h += torch.distributions.Categorical(logits=logits / t.temperature).entropy().tolist()
    assert torch.allclose(tempered.detach(), torch.tensor(expected_t), atol=1e-5)
    assert torch.allclose(entropy, torch.tensor(expected_h), atol=1e-4)
    assert not entropy.requires_grad and score(model, batch, entropy_grad=True).entropy.requires_grad


def test_score_keeps_for_the_backward_only_the_heads_logits_and_scores_chunks_alike(monkeypatch):
    """The vocabulary-wide fp32 math runs a chunk of rows at a time, recomputed in the backward: of the tensors as
    large as [response tokens, vocabulary], the graph holds the head's own logits (in the model's dtype) and no
    fp32 copy; chunks of 7 rows give the same scores and gradients as one chunk."""
    from lightning_ray.learner import scoring

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16)
    batch = collate([(t, 1.0) for t in batch_of(6)], pad_id=0)
    results = []
    for elements in (1 << 26, 7 * TINY["vocab_size"]):
        monkeypatch.setattr(scoring, "SCORED_ELEMENTS", elements)
        model.zero_grad()
        held = []

        def pack(x):
            if x.dim() == 2 and x.shape[-1] == TINY["vocab_size"]:  # [tokens, vocabulary]: logits, a chunk's too
                held.append(x.dtype)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            scores = score(model, batch, entropy_grad=True)
        (scores.logprobs.sum() + scores.entropy.sum()).backward()
        assert held and set(held) == {torch.bfloat16}, held
        results.append((*scores[:2], torch.cat([p.grad.flatten() for p in model.parameters()])))
    for one, chunked in zip(*results):
        assert torch.equal(one.detach(), chunked.detach())


def test_the_warm_ups_loss_is_the_models_own_with_a_mask_and_labels(model):
    """The tiny and rag models' warm-ups skip the attention mask and the LM head on padding (models/tiny.py): on
    right-padded rows, the loss and its gradient are what the model's own with a mask and -100 labels give."""
    rows = [torch.randint(1, 97, (n,)) for n in (5, 19, 12)]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    real = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r), dtype=torch.bool) for r in rows], batch_first=True)
    out = []
    for loss in (lambda: model(input_ids=ids, attention_mask=real.long(), labels=ids.masked_fill(~real, -100)).loss,
                 lambda: next_token_loss(model, ids, real[:, 1:])):
        model.zero_grad()
        value = loss()
        value.backward()
        out.append((value.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (expected, expected_grad), (ours, grad) = out
    assert ours == pytest.approx(expected, rel=1e-6) and torch.allclose(grad, expected_grad, atol=1e-6)
    model.zero_grad()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "token_sum"])
def test_micro_batches_accumulate_the_gradient_of_the_whole_batch(model, aggregation):
    transitions = batch_of(9, seed=1)
    weighted = list(zip(transitions, token_weights(transitions, aggregation, max_tokens=12)))

    def gradient(token_budget: int) -> tuple[torch.Tensor, int]:
        model.zero_grad()
        packed = micro_batches(weighted, token_budget)
        for mb in packed:
            batch = collate(mb, pad_id=0)
            logprobs, *_ = score(model, batch)
            loss, _ = policy_loss(logprobs, logprobs.detach(), batch["advantages"], batch["weights"], 0.2)
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), len(packed)

    whole, one = gradient(10_000)
    split, many = gradient(64)
    assert one == 1 and many > 3
    assert torch.allclose(whole, split, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "token_sum"])
def test_a_merged_episode_gets_the_gradient_of_its_separate_calls(model, aggregation):
    """Trajectory level: one sequence with the tool result masked out scores each action exactly as the separate
    calls do (causal attention: the same context before each token), and each call keeps its weight in the loss
    (calls of 2 and 1 tokens, beside another episode's single call), so the gradient is the same."""
    first = Transition(rollout_id="a", group_id="g", span_id="1", prompt_ids=[5, 6, 7], response_ids=[8, 9],
                       logprobs=[-1.0, -1.0], reward=1.0, advantage=1.0, policy_version=0)
    second = Transition(**{**first.model_dump(), "span_id": "2", "prompt_ids": [5, 6, 7, 8, 9, 40, 41],
                           "response_ids": [10], "logprobs": [-1.0]})
    alone = Transition(**{**first.model_dump(), "rollout_id": "b", "span_id": "3", "response_ids": [11, 12, 13],
                          "logprobs": [-1.0] * 3, "advantage": -0.5})
    merged, breaks = merge_calls([first, second, alone])
    assert breaks == 0 and len(merged) == 2 and merged[0].call_tokens == [2, 1]

    def gradient(transitions):
        model.zero_grad()
        batch = collate(list(zip(transitions, token_weights(transitions, aggregation, 10))), pad_id=0)
        logprobs, *_ = score(model, batch)
        loss, _ = policy_loss(logprobs, logprobs.detach(), batch["advantages"], batch["weights"], 0.2)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), logprobs.detach()

    (g_sep, lp_sep), (g_merged, lp_merged) = gradient([first, second, alone]), gradient(merged)
    assert torch.allclose(lp_sep, lp_merged, atol=1e-5)
    assert torch.allclose(g_sep, g_merged, atol=1e-6, rtol=1e-4)


def test_activation_checkpointing_gives_the_same_gradient(model):
    """The GPU default (learner.gradient_checkpointing: auto) recomputes activations in backward: same numbers."""
    transitions = batch_of(5, seed=2)
    batch = collate([(t, 1.0) for t in transitions], pad_id=0)

    def gradient() -> torch.Tensor:
        model.zero_grad()
        logprobs, *_ = score(model, batch)
        loss, _ = policy_loss(logprobs, logprobs.detach(), batch["advantages"], batch["weights"], 0.2)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    plain = gradient()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        checkpointed = gradient()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert torch.allclose(plain, checkpointed, atol=1e-7, rtol=1e-5)


def alike_batch(n: int, seed: int = 0) -> list[Transition]:
    """Rows whose prompts open alike, as an agent's calls do (a system prompt, the same context), each its own
    ending and response; two of them one group's identical prompts."""
    rng = random.Random(seed)
    opening = [rng.randrange(1, 97) for _ in range(40)]
    rows = batch_of(n, seed)
    for t in rows:
        ending = [rng.randrange(1, 97) for _ in range(rng.randint(1, 5))]
        t.prompt_ids = np.array(opening[: rng.randint(30, 40)] + ending)
    rows[1].prompt_ids = rows[0].prompt_ids.copy()
    return rows


@pytest.mark.parametrize("model_class, config", [
    (LlamaForCausalLM, LlamaConfig(**TINY)),
    (LlamaForCausalLM, LlamaConfig(**TINY, attn_implementation="eager")),  # a bf16 learner's on CPUs
    (Gemma2ForCausalLM, Gemma2Config(**TINY, sliding_window=8)),  # its sliding layers see less than the prefix
    (WithValueHead, LlamaConfig(**TINY)),  # PPO's critic on the same trunk
])
def test_a_shared_prefix_runs_once_and_scores_as_each_row_alone(model_class, config):
    torch.manual_seed(0)
    model = (WithValueHead(LlamaForCausalLM(config)) if model_class is WithValueHead else model_class(config)).float()
    rows = alike_batch(6)
    out = []
    for share in (False, True):
        model.zero_grad()
        batch = collate([(t, 1.0) for t in rows], pad_id=0, share_prefix=share)
        scores = score(model, batch, entropy_grad=True)
        (scores.logprobs.sum() + scores.entropy.sum() + (scores.values.sum() if scores.values is not None else 0)
         ).backward()
        out.append((batch["shared"], scores, torch.cat([p.grad.flatten() for p in model.parameters()])))
    (none, alone, grad_alone), (shared, together, grad_together) = out
    assert none == 0 and shared >= 30
    for a, b in zip(alone, together):
        assert a is b is None or torch.allclose(a, b, atol=1e-5)
    # float32 summed in another order: ~1e-6 of the largest entries (~5), more than 1e-6 absolute on an AVX-512 host
    assert torch.allclose(grad_alone, grad_together, atol=1e-5, rtol=1e-4)


def test_the_shared_prefix_stops_short_of_every_rows_first_action():
    rows = alike_batch(4)
    rows[2].prompt_ids = rows[0].prompt_ids[:3].copy()
    assert shared_prefix(rows) == 2  # the 3-token prompt's last token predicts its first action
    assert shared_prefix(rows[:1]) == 0 and shared_prefix([rows[0], rows[1]]) == len(rows[0].prompt_ids) - 1
    rows[3].prompt_ids = np.array([96, *rows[3].prompt_ids[1:]])
    assert shared_prefix(rows) == 0


def test_micro_batches_with_shared_prefixes_hold_alike_rows_within_the_budget(model):
    """Rows sorted by prompt: alike ones together, the prefix counted once, so a micro-batch holds more of them, and
    the accumulated gradient is the whole batch's all the same."""
    rows = alike_batch(8, seed=3) + batch_of(4, seed=4)  # and four rows unlike the rest
    weighted = list(zip(rows, token_weights(rows, "token_mean", max_tokens=12)))

    def gradient(share: bool) -> tuple[torch.Tensor, list]:
        model.zero_grad()
        packed = micro_batches(weighted, 120, share_prefix=share)
        for mb in packed:
            batch = collate(mb, pad_id=0, share_prefix=share)
            logprobs, *_ = score(model, batch)
            loss, _ = policy_loss(logprobs, logprobs.detach(), batch["advantages"], batch["weights"], 0.2)
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), packed

    (alone, by_length), (together, by_prompt) = gradient(False), gradient(True)
    assert torch.allclose(alone, together, atol=1e-6, rtol=1e-4)
    assert len(by_prompt) < len(by_length)
    for mb in by_prompt:
        mine = [t for t, _ in mb]
        width = max(len(t.prompt_ids) + len(t.response_ids) for t in mine)
        assert len(mine) == 1 or shared_prefix(mine) + len(mine) * (width - shared_prefix(mine)) <= 120
    assert sorted(id(t) for mb in by_prompt for t, _ in mb) == sorted(map(id, rows))


def test_the_parameter_digest_is_the_values_whatever_their_dtype_or_order(model):
    """Ranks, checkpoints and engines are compared by it: equal values, equal digests (bf16 weights held exactly in
    fp32 too); any changed value or swapped pair changes it."""
    bf16 = LlamaForCausalLM(model.config).to(torch.bfloat16)
    same = LlamaForCausalLM(model.config)
    same.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    assert parameter_digest(bf16) == parameter_digest(same)
    with torch.no_grad():
        w = same.model.layers[0].mlp.up_proj.weight
        w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()  # a permutation keeps every plain sum
    assert parameter_digest(same) != parameter_digest(bf16)


def test_the_digest_reads_its_checksums_back_at_once(model):
    """No scalar read per tensor (on a GPU each waits for it to drain: ~300 a step for Qwen2.5-0.5B): the checksums
    stay on the device until one copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    with ScalarReads() as reads:
        parameter_digest(model)
    assert reads.count == 0


def test_the_digest_is_the_same_whatever_its_chunks():
    """The checksum is taken a chunk at a time, each weighted from its own start: any chunk size gives one value,
    and a swap across a chunk's edge still changes it."""
    t = torch.randn(1_000)
    whole = int(_bits_checksum(t, chunk=4_096))
    assert {int(_bits_checksum(t, chunk=c)) for c in (7, 64, 999, 1_000)} == {whole}
    t[63], t[64] = t[64].clone(), t[63].clone()
    assert int(_bits_checksum(t, chunk=64)) != whole


@pytest.mark.parametrize("model_class, config", [
    (Gemma2ForCausalLM, Gemma2Config(**TINY, final_logit_softcapping=0.05)),  # tanh soft-capping of the logits
    (GraniteForCausalLM, GraniteConfig(**TINY, logits_scaling=0.25)),  # logits divided by it
])
def test_score_applies_the_models_own_logit_processing(model_class, config):
    torch.manual_seed(0)
    model = model_class(config).float()
    transitions = batch_of(4, seed=6)
    tempered, *_ = score(model, collate([(t, 1.0) for t in transitions], pad_id=0))
    expected = []
    with torch.no_grad():
        for t in transitions:
            ids = torch.tensor([[*t.prompt_ids, *t.response_ids]], dtype=torch.long)
            logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1]
            target = torch.from_numpy(t.response_ids).long()[:, None]
            expected += torch.log_softmax(logits.float() / t.temperature, -1).gather(-1, target).squeeze(-1).tolist()
    assert torch.allclose(tempered.detach(), torch.tensor(expected), atol=1e-5)


# ---- train_step: the steps a batch takes, through a real DeepSpeed engine ----------------------------------------
def engine_for(model: torch.nn.Module, stage: int = 0, lr: float = 1e-2, dtype: str = "float32"):
    t = LearnerConfig(zero_stage=stage, lr=lr, weight_decay=0.0, grad_clip=1.0, dtype=dtype)
    return deepspeed_engine(model, [{"params": list(model.parameters())}], t, on_cuda=False)


def step(engine, transitions: list[Transition], max_logprob_gap: float | None = None, **algorithm) -> dict:
    """train_step on one rank, the batch planned as the learner plans it."""
    alg = AlgorithmConfig(**algorithm)
    plan = batch_plan(transitions, alg, max_tokens=12, token_budget=256, ranks=1)[0]
    return train_step(engine, plan, 0, alg, 1, max_logprob_gap=max_logprob_gap)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_resumed_learner_takes_its_own_learning_rate_not_the_checkpoints(one_rank, stage, tmp_path):
    """The optimizer state comes back from the checkpoint, the learning rate from the resumed run's config."""
    saved = engine_for(fresh(), stage, lr=1e-2)
    step(saved, alike_batch(4, seed=1))
    save_state(saved, tmp_path, adapters=[])
    resumed = engine_for(fresh(), stage, lr=3e-3)
    load_state(resumed, tmp_path, adapters=[], rates=[3e-3])
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [3e-3]
    assert parameter_digest(resumed.module) == parameter_digest(saved.module)  # the weights did come back


def test_a_resumed_learner_refuses_its_adapters_in_another_order(one_rank, tmp_path):
    """The optimizer's groups, one per adapter, are matched by their order alone: another order would give each
    adapter another's moments."""
    from lightning_ray.learner import lora
    from lightning_ray.learner.worker import parameter_groups

    def engine(names: list[str]):
        model = lora.with_adapter(fresh(), LoraConfig(rank=4), names)
        t = LearnerConfig(zero_stage=0, lr=1e-2, weight_decay=0.0, grad_clip=1.0)
        return deepspeed_engine(model, parameter_groups(model, names), t, on_cuda=False)

    save_state(engine(["writer", "rewriter"]), tmp_path, ["writer", "rewriter"])
    with pytest.raises(ValueError, match=r"\['writer', 'rewriter'\], in that order.*resume with the same"):
        load_state(engine(["rewriter", "writer"]), tmp_path, ["rewriter", "writer"], [1e-2, 1e-2])
    load_state(engine(["writer", "rewriter"]), tmp_path, ["writer", "rewriter"], [1e-2, 1e-2])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_over_several_micro_batches_makes_the_whole_batchs_update(one_rank, stage):
    """Split into micro-batches or not, with shared prefixes or not, one step makes the same update, at ZeRO-3 too:
    it counts micro-steps in the engine's forward, which `score` does not go through (worker.micro_step); uncounted,
    each micro-batch's gradient replaced the one before."""
    import deepspeed

    rows, alg = alike_batch(8, seed=5), AlgorithmConfig()

    def updated(token_budget: int, share: bool) -> tuple[torch.Tensor, int]:
        engine = engine_for(fresh(), stage)
        plan = batch_plan(rows, alg, max_tokens=12, token_budget=token_budget, ranks=1, share_prefix=share)[0]
        assert train_step(engine, plan, 0, alg, 1, share_prefix=share)["updated"]
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            return torch.cat([p.detach().flatten().clone() for p in params]), len(plan[0])

    whole, one = updated(100_000, share=False)
    assert one == 1 and not torch.equal(whole, torch.cat([p.detach().flatten() for p in fresh().parameters()]))
    for share in (False, True):
        split, many = updated(128, share)
        # Adam's steps are lr 1e-2 each, whatever a gradient's size: alike to 1% of one (a lost micro-batch: 100%)
        assert many > 1 and torch.allclose(whole, split, atol=1e-4)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bf16_step_over_several_micro_batches_makes_the_whole_batchs_gradient(one_rank, stage):
    """In DeepSpeed's bf16 mode too (one rank's ZeRO-1 is its BF16_Optimizer, a GPU's default): that optimizer adds
    each backward's bf16 gradients into its fp32 ones and clears them in the backward prologue that engine.forward
    hooks, which `score` does not go through (worker.micro_step); uncleared, the first of n micro-batches counted n
    times. bf16 rounds the gradient, so Adam's sign-sized steps differ in a few weights: the gradients' norms are
    compared (the split's was 2.1x the whole's)."""
    rows, alg = alike_batch(8, seed=5), AlgorithmConfig()

    def step_norm(token_budget: int) -> tuple[float, int]:
        plan = batch_plan(rows, alg, max_tokens=12, token_budget=token_budget, ranks=1)[0]
        return train_step(engine_for(fresh(), stage, dtype="bfloat16"), plan, 0, alg, 1)["grad_norm"], len(plan[0])

    (whole, one), (split, many) = step_norm(100_000), step_norm(128)
    assert one == 1 and many > 1 and split == pytest.approx(whole, rel=0.01)


def test_a_bf16_step_takes_its_fp32_accumulated_gradient_unrounded(one_rank, monkeypatch):
    """The gradient clipped and stepped on is the fp32 sum of the micro-batches' bf16 gradients, not that sum rounded
    back to bf16 (DeepSpeed's default: its all-reduce, one rank's too, in the compute dtype)."""
    engine = engine_for(fresh(), 1, dtype="bfloat16")
    optimizer, seen = engine.optimizer, []
    monkeypatch.setattr(optimizer, "step", lambda *a, step=optimizer.step, **k: (
        seen.append(optimizer.fp32_groups_gradients_flat[0].clone()), step(*a, **k))[1])
    alg = AlgorithmConfig()
    train_step(engine, batch_plan(alike_batch(8, seed=5), alg, max_tokens=12, token_budget=128, ranks=1)[0], 0, alg,
               1)
    [gradient] = seen
    assert gradient.abs().sum() > 0 and not torch.equal(gradient, gradient.bfloat16().float())


def test_the_engine_starts_without_building_deepspeeds_comm_op(one_rank, tmp_path, monkeypatch):
    """DeepSpeed's CPU backend would compile its inference all-reduce op (~1 min, a compiler needed) at its first
    start; training never calls it."""
    import deepspeed.comm.comm as ds_comm

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # a build would land here
    monkeypatch.setattr(ds_comm, "cdb", None)  # a backend started afresh, as in a new learner process
    engine_for(fresh())
    assert ds_comm.cdb.shm_comm_op is None and not list(tmp_path.iterdir())


def test_the_default_is_one_on_policy_step(one_rank):
    """ppo_epochs = mini_batches = 1: one step whose ratio is 1 (the old logprobs are the current ones), the
    textbook step: the loss's gradient, clipped to norm 1, one AdamW step."""
    transitions = batch_of(6, seed=3)
    engine = engine_for(fresh())
    stats = step(engine, transitions)
    assert stats["steps"] == 1 and stats["clip_frac"] == 0 and stats["updated"] and not stats["skipped_nonfinite"]
    expected = fresh()
    batch = collate(list(zip(transitions, token_weights(transitions, "token_mean", 12))), pad_id=0)
    logprobs, *_ = score(expected, batch)
    loss, _ = policy_loss(logprobs, logprobs.detach(), batch["advantages"], batch["weights"], 0.2)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(expected.parameters(), 1.0)
    torch.optim.AdamW(expected.parameters(), lr=1e-2, weight_decay=0.0).step()
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert stats["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    for trained, textbook in zip(engine.module.parameters(), expected.parameters()):
        # Adam's first step is ~lr × sign(gradient): a gradient entry of ~0 may take either sign
        assert torch.allclose(trained, textbook, atol=1e-5)


def test_more_epochs_and_mini_batches_move_the_ratio_and_the_clip_acts(one_rank):
    transitions = batch_of(8, seed=3)
    runs = {}
    for high in (None, 0.28):
        engine = engine_for(fresh())
        stats = step(engine, transitions, ppo_epochs=2, mini_batches=2, clip_eps_high=high)
        runs[high] = stats, parameter_digest(engine.module)
    stats, digest = runs[None]
    assert stats["steps"] == 4 and stats["clip_frac"] > 0 and stats["updated"]
    assert runs[0.28][1] != digest  # clip-higher let some ratios rise further: another update


def test_each_mini_batch_normalizes_its_own_loss_and_every_rank_steps_alike():
    transitions = batch_of(9, seed=5)
    plan = batch_plan(transitions, AlgorithmConfig(mini_batches=2), max_tokens=12, token_budget=64, ranks=2)
    assert [len(mini_batches) for mini_batches in plan] == [2, 2]  # two optimizer steps on each rank
    for m in range(2):
        assert len(plan[0][m]) == len(plan[1][m])  # as many backward passes on each rank (some empty)
        rows = [row for rank in plan for mb in rank[m] for row in mb]
        assert sum(float(np.sum(w)) for _, w in rows) == pytest.approx(1.0)  # token_mean over this mini-batch
    assert sorted(t.span_id for rank in plan for mini in rank for mb in mini for t, _ in mb) == \
        sorted(t.span_id for t in transitions)


def test_kl_and_entropy_terms_keep_the_transitions_without_advantage():
    """Zero advantage, no policy-gradient signal: left out, unless a KL or entropy term is in the loss, which acts
    on every token."""
    transitions = [t.model_copy(update={"advantage": 0.0}) if i % 2 else t for i, t in enumerate(batch_of(6))]

    def trained(**algorithm) -> int:
        plan = batch_plan(transitions, AlgorithmConfig(**algorithm), max_tokens=12, token_budget=256, ranks=1)
        return sum(len(mb) for mini in plan[0] for mb in mini)

    assert trained() == 3
    assert trained(entropy_coef=0.01) == trained(kl_coef=0.1) == 6


@pytest.mark.parametrize("stage", [0, 1])  # our own check, and DeepSpeed's ZeRO optimizer's
def test_a_step_whose_loss_is_not_finite_is_skipped(one_rank, stage):
    engine = engine_for(fresh(), stage)
    good = batch_of(6, seed=4)
    before = parameter_digest(engine.module)
    for bad in (math.inf, math.nan):
        poisoned = [good[0].model_copy(update={"advantage": bad}), *good[1:]]
        stats = step(engine, poisoned)
        assert stats["skipped_nonfinite"] == stats["steps"] == 1 and not stats["updated"]
        assert parameter_digest(engine.module) == before
    # one of two mini-batches poisoned: only its step is skipped
    stats = step(engine, poisoned, mini_batches=2)
    assert stats["skipped_nonfinite"] == 1 and stats["steps"] == 2 and stats["updated"]
    # and nothing of it was left behind (gradients, Adam's moments): the next batch trains as usual
    stats = step(engine, good)
    assert stats["updated"] and math.isfinite(stats["grad_norm"]) and math.isfinite(stats["loss"])
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


def test_a_grammar_constrained_calls_masked_logprobs_neither_fail_the_first_step_nor_weigh_its_tokens(
        one_rank, tokenizer, small_model):
    """The HF engine samples one call freely and one under a JSON schema: the constrained call's logprobs are the
    grammar-masked distribution's (nats above the learner's whole-vocabulary ones on a random model), which neither
    trips learner.max_logprob_gap nor importance-weights its tokens (min(ratio, cap) would have made them ~0), and the
    tokens the grammar alone allowed (logprob 0) are out of the loss. The same weights serve and train."""
    import asyncio

    from lightning_ray.algorithm.lightningrl import transitions_from_spans
    from lightning_ray.serving.engines import SamplingParams, generate, make_engine
    from lightning_ray.tracing import semconv
    from lightning_ray.types import Rollout, Span, Task

    served = make_engine("hf", small_model, dtype="float32")
    prompt = tokenizer.encode("a question")
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    spans = []
    for i, constraint in enumerate((None, schema)):
        out = asyncio.run(generate(served, prompt, SamplingParams(max_tokens=12, seed=i, json_schema=constraint)))
        spans.append(Span(rollout_id="r", attempt_id="a", name=semconv.LLM_CALL, start_time=i, origin="server",
                          attributes={semconv.MODEL: "policy", semconv.PROMPT_TOKEN_IDS: prompt,
                                      semconv.COMPLETION_TOKEN_IDS: out.token_ids, semconv.LOGPROBS: out.logprobs,
                                      semconv.POLICY_VERSION: 0, semconv.FINISH_REASONS: [out.finish_reason],
                                      semconv.SAMPLING: {"temperature": 1.0, "constrained": constraint is not None}}))
    rollout = Rollout(rollout_id="r", task=Task(task_id="t", input={}), attempt_id="a", reward=1.0)
    free, constrained = transitions_from_spans(rollout, spans, "policy")
    assert not free.constrained and constrained.constrained
    assert constrained.loss_mask.tolist() == (constrained.logprobs != 0).tolist()  # forced tokens: no action
    free, constrained = (t.model_copy(update={"advantage": 1.0}) for t in (free, constrained))
    learner = engine_for(LlamaForCausalLM.from_pretrained(small_model).float(), lr=1e-9)
    with torch.no_grad():
        learners = score(learner.module, collate([(constrained, 1.0)], pad_id=0)).logprobs.numpy()
    assert (constrained.logprobs[constrained.action_mask == 1] - learners).mean() > 1  # the grammar's mass
    stats = step(learner, [free, constrained], max_logprob_gap=0.1, tis_cap=2.0)
    assert stats["logprob_abs_diff"] < 1e-4  # the free call's tokens alone, as the server sampled them
    # the first step's ratio is 1 and every advantage 1: the loss is -(Σ weights × importance weights) = -1
    assert stats["loss"] == pytest.approx(-1.0, abs=1e-3)


def test_a_first_step_far_from_the_servers_logprobs_fails_before_any_update(one_rank):
    transitions = batch_of(4, seed=7)  # served logprobs of -1: nothing like this model's
    engine = engine_for(fresh())
    before = parameter_digest(engine.module)
    with pytest.raises(ValueError, match="learner.max_logprob_gap=0.1"):
        step(engine, transitions, max_logprob_gap=0.1)
    assert parameter_digest(engine.module) == before
    with torch.no_grad():  # what a server running these weights reports
        served = [score(fresh(), collate([(t, 1.0)], pad_id=0)).logprobs.numpy() for t in transitions]
    transitions = [t.model_copy(update={"logprobs": lp.astype(np.float64)}) for t, lp in zip(transitions, served)]
    stats = step(engine_for(fresh()), transitions, max_logprob_gap=0.1)
    assert stats["updated"] and stats["logprob_abs_diff"] < 1e-5


def test_a_call_drawn_within_a_nucleus_is_importance_weighted_not_compared(one_rank):
    """top_p < 1: the engine's logprobs are renormalized within the nucleus, above the learner's over the whole
    vocabulary. Not a sign of another policy (left out of learner.max_logprob_gap's check), but the ratio truncated
    importance sampling weighs by: π_learner / π_sampler < 1 on those tokens."""
    transitions = [t.model_copy(update={"advantage": 1.0}) for t in batch_of(4, seed=9)]
    with torch.no_grad():  # a server running these weights, the odd calls drawn within a nucleus
        served = [score(fresh(), collate([(t, 1.0)], pad_id=0)).logprobs.numpy() + (i % 2) for i, t in
                  enumerate(transitions)]
    nucleus_share = sum(len(t.response_ids) for t in transitions[1::2]) / sum(len(t.response_ids) for t in transitions)
    assert 0.1 < nucleus_share < 0.9
    drawn = [t.model_copy(update={"logprobs": lp.astype(np.float64)}) for t, lp in zip(transitions, served)]
    with pytest.raises(ValueError, match="learner.max_logprob_gap"):  # the same numbers from full-vocabulary calls
        step(engine_for(fresh()), drawn, max_logprob_gap=0.1)
    drawn = [t.model_copy(update={"top_p": 0.9 if i % 2 else 1.0}) for i, t in enumerate(drawn)]
    stats = step(engine_for(fresh()), drawn, max_logprob_gap=0.1, tis_cap=2.0)
    assert stats["logprob_abs_diff"] < 1e-5  # the full-vocabulary calls alone
    # the first step's ratio is 1 and every advantage 1: the loss is -(Σ weights × importance weights), each weight
    # 1 but e^-1 on the nucleus calls' tokens
    assert -1 + 1e-3 < stats["loss"] < -math.exp(-1)
    every = step(engine_for(fresh()), [t.model_copy(update={"top_p": 0.9}) for t in drawn], max_logprob_gap=0.1)
    assert every["updated"] and every["logprob_abs_diff"] is None  # no token to compare: none, not a perfect 0


def test_sft_scores_at_1_calls_drawn_at_another_temperature_neither_compared_nor_weighted(one_rank):
    """algorithm.objective=sft scores at temperature 1 what was drawn at 0.7: the served logprobs (at 0.7) are not
    the learner's to match, nor to importance-weight by (the loss is the NLL's). Before, the first step with the
    default sampling temperature failed learner.max_logprob_gap."""
    from lightning_ray.algorithm.advantages import best_rollouts

    transitions = [t.model_copy(update={"temperature": 0.7, "reward": float(i % 2)}) for i, t in
                   enumerate(batch_of(4, seed=11))]
    with torch.no_grad():  # a server running these weights, sampling at 0.7
        served = [score(fresh(), collate([(t, 1.0)], pad_id=0)).logprobs.numpy() for t in transitions]
    drawn = [t.model_copy(update={"logprobs": lp.astype(np.float64)}) for t, lp in zip(transitions, served)]
    assert step(engine_for(fresh()), drawn, max_logprob_gap=0.1)["logprob_abs_diff"] < 1e-5  # RL: at 0.7, alike
    kept = [t for t in best_rollouts(drawn, min_reward=1.0) if t.advantage]
    stats = step(engine_for(fresh()), kept, max_logprob_gap=0.1, tis_cap=2.0)
    assert stats["updated"] and stats["logprob_abs_diff"] is None  # nothing comparable: none, not a failure
    # the first step's ratio is 1 and every advantage 1: -(Σ weights × importance weights) = -1 with weights of 1
    assert stats["loss"] == pytest.approx(-1.0, abs=1e-5)
