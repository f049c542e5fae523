"""algorithm.objective=sft (rejection-sampling fine-tuning): which transitions are imitated, and that the learner's
loss on them has the gradient of their negative log-likelihood."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ray.algorithm.advantages import best_rollouts
from lightning_ray.algorithm.loss import policy_loss, token_weights
from lightning_ray.config import ConfigError, validate
from lightning_ray.learner.scoring import collate, score
from lightning_ray.types import Transition


def call(rollout: str, group: str, reward: float, prompt=(5, 6, 7), response=(8, 9), step=0) -> Transition:
    return Transition(rollout_id=rollout, group_id=group, span_id=f"{rollout}{step}", prompt_ids=list(prompt),
                      response_ids=list(response), logprobs=[-1.0] * len(response), reward=reward, step=step,
                      policy_version=0, temperature=0.7)


def test_each_group_keeps_its_best_rollouts_that_reach_the_bar():
    batch = [
        # g1: a and c tie for best (both of a's calls kept); b scored less
        call("a", "g1", 1.0), call("a", "g1", 1.0, step=1), call("b", "g1", 0.0), call("c", "g1", 1.0),
        call("d", "g2", 0.5), call("e", "g2", 0.25),  # g2: its best is below the bar
        call("f", "g3", 2.0), call("h", "g3", 1.5),  # g3: h reaches the bar but is not the best
    ]
    out = best_rollouts(batch, min_reward=1.0)
    assert [(t.rollout_id, t.advantage) for t in out] == [
        ("a", 1.0), ("a", 1.0), ("b", 0.0), ("c", 1.0), ("d", 0.0), ("e", 0.0), ("f", 1.0), ("h", 0.0)]
    assert {(t.temperature, t.score_temperature) for t in out} == {(0.7, 1.0)}  # sampled at 0.7, scored at 1
    assert [t.rollout_id for t in best_rollouts(batch, min_reward=0.5) if t.advantage] == ["a", "a", "c", "d", "f"]


def test_the_sft_loss_has_the_gradient_of_the_mean_nll():
    """Through the learner's own path (best_rollouts, token_mean weights, collate, score, the PPO-clip loss at ratio
    1), the gradient equals that of the mean negative log-likelihood of the kept tokens under the untempered model,
    computed the textbook way, one unpadded row at a time."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         pad_token_id=0)).float()
    batch = [call("a", "g", 1.0, [3, 4, 5, 6], [7, 8, 9]), call("b", "g", 0.0, [3, 4], [10]),
             call("c", "g", 1.0, [11, 12], [13, 14, 15, 16, 17]), call("d", "h", 0.0, [20], [21, 22])]
    kept = [t for t in best_rollouts(batch, min_reward=1.0) if t.advantage != 0]  # as Learner.step takes them
    assert [t.rollout_id for t in kept] == ["a", "c"]

    model.zero_grad()
    rows = collate(list(zip(kept, token_weights(kept, "token_mean", max_tokens=8))), pad_id=0)
    logprobs, *_ = score(model, rows)
    loss, _ = policy_loss(logprobs, logprobs.detach(), rows["advantages"], rows["weights"], clip_eps=0.2)
    loss.backward()
    sft = torch.cat([p.grad.flatten() for p in model.parameters()])

    model.zero_grad()
    nll = []
    for t in kept:
        ids = torch.tensor([[*t.prompt_ids, *t.response_ids]], dtype=torch.long)
        logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1]
        nll.append(torch.nn.functional.cross_entropy(logits, torch.from_numpy(t.response_ids).long(), reduction="none"))
    torch.cat(nll).mean().backward()  # 8 tokens, each counts the same
    expected = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert expected.norm() > 0
    assert torch.allclose(sft, expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("algorithm, named", [
    ({"credit": "per_step", "level": "transition"}, "algorithm.credit"),
    ({"estimator": "rloo"}, "algorithm.estimator"),
    ({"baseline": "turn", "level": "transition"}, "algorithm.baseline"),
    ({"objective": "dpo"}, "algorithm.objective"),
])
def test_sft_with_rl_only_options_is_refused_by_key(algorithm, named):
    with pytest.raises(ConfigError, match=named):
        validate({"run_dir": "x", "algorithm": {"objective": "sft", **algorithm}})
    if algorithm.get("objective") != "dpo":
        validate({"run_dir": "x", "algorithm": algorithm})  # each is fine for RL


def test_rl_after_imitation_draws_other_training_tasks_than_the_imitation_did(tmp_path):
    """RL that goes on from an imitation checkpoint learns from questions it has not imitated: with one sampler seed
    for both, random.sample's first draws coincide and every RL task of the first iterations was an imitated one
    (the warm start's RL then saw only memorised questions: 0.84 training reward against 0.57 held-out)."""
    import random
    from types import SimpleNamespace

    from lightning_ray.config import compose
    from lightning_ray.tasks import load_splits
    from lightning_ray.trainer.collect import draw

    def drawn(config_name: str, iterations: int) -> set[str]:
        cfg = compose([f"run_dir={tmp_path / config_name}", "task=sql"], config_name)
        run = SimpleNamespace(cfg=cfg, rng=random.Random(cfg.seed), train_tasks=load_splits(cfg.task)[0])
        return {t.task_id for _ in range(iterations) for t in draw(run)}

    imitated, reinforced = drawn("imitate", 13), drawn("train", 13)
    # 13 x 16 of 1,000 imitated, the families in turn (task.balance): an independent draw of RL's 13 x 16 shares
    # ~34% (the small families' few questions come up in both; ~15% drawn uniformly), not all of them
    assert len(imitated & reinforced) < 0.5 * len(reinforced)
