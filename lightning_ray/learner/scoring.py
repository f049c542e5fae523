"""A micro-batch as the learner's tensors (`collate`), and what the policy makes of it (`score`): each action token's
logprob, entropy and, for PPO, the value head's estimate (`WithValueHead`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from lightning_ray.learner import lora
from lightning_ray.types import Transition

if TYPE_CHECKING:
    from transformers import DynamicCache

SCORED_ELEMENTS = 1 << 26  # logits scored at once (a chunk's fp32 copy: 256 MiB)
# transitions with the weights of their action tokens in the loss (one for all, or one each: loss.token_weights)
MicroBatch = list[tuple[Transition, float | np.ndarray]]


class WithValueHead(torch.nn.Module):
    """PPO's actor and critic as one module, so one DeepSpeed engine and optimizer step both: the policy, and a
    linear value head on its last hidden state (sharing the policy's trunk). Only the policy is published."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy
        self.value_head = torch.nn.Linear(policy.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)  # V = 0 at first: the first advantages are the rewards' own
        torch.nn.init.zeros_(self.value_head.bias)


def policy_of(module: torch.nn.Module) -> torch.nn.Module:
    return module.policy if isinstance(module, WithValueHead) else module


class Scores(NamedTuple):
    logprobs: torch.Tensor  # under each call's sampling temperature (with gradient)
    entropy: torch.Tensor  # of each position's sampling distribution
    values: torch.Tensor | None  # the value head's estimate at each position (a critic's module only)


def score(module: torch.nn.Module, batch: dict[str, torch.Tensor], entropy_grad: bool = False) -> Scores:
    """Per response token, flat in row order: its logprob under the call's sampling temperature (with gradient);
    the entropy of the position's sampling distribution (with gradient for an entropy bonus); a
    critic's value estimate. Only the positions that predict a response token go through the LM head, so the
    [rows, width, vocabulary] logits of the whole micro-batch never exist; they do go through the model's own
    forward after the decoder, whatever it does to the logits (Gemma-2's soft-capping, Granite's scaling, ...).
    The rows' shared prompt prefix (collate's `shared` tokens) goes through the model once, its keys and values
    repeated for every row, their gradients summed back by autograd: the same scores, for a fraction of the work
    where prompts are long and alike (an agent's system prompt and context, a group's prompt)."""
    model = policy_of(module)
    if batch.get("adapter") is not None and lora.is_adapted(model):  # algorithm.adapters: set by train_step
        lora.use_adapter(model, batch["adapter"])
    ids, predicts = batch["input_ids"], batch["mask"].bool()
    shared, cache = batch.get("shared", 0), None
    if shared:  # the prefix predicts no action (collate keeps it short of every row's first): no head at all
        from transformers import DynamicCache

        cache = DynamicCache()
        actions_forward(model, ids[:1, :shared], predicts[:1, : shared - 1], cache)
        cache.batch_repeat_interleave(len(ids))
    states, logits = actions_forward(model, ids[:, shared:], predicts[:, shared:], cache)
    targets = ids[:, 1:][predicts]
    temperature = batch["temperature"][:, None].expand_as(predicts)[predicts]
    # The vocabulary-wide fp32 math a chunk of rows at a time, recomputed in the backward: held for it are the
    # head's logits only, not several fp32 [response tokens, vocabulary] copies (a 1.5B Qwen's 16k-token micro-batch
    # of responses: ~9 GB each)
    grad = torch.is_grad_enabled()
    chunks = [checkpoint(token_scores, *chunk, entropy_grad, use_reentrant=False) if grad else token_scores(*chunk)
              for chunk in zip(*(x.split(SCORED_ELEMENTS // logits.shape[-1] or 1) for x in
                                 (logits, targets, temperature)))]
    logprobs, entropy = (torch.cat(x) for x in zip(*chunks))
    values = module.value_head(states).squeeze(-1).float() if isinstance(module, WithValueHead) else None
    return Scores(logprobs, entropy, values)


def token_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the head's logits -> each target's logprob at the row's temperature, and the entropy of the tempered
    distribution (with gradient only for an entropy bonus: else the backward's recompute stops at the logprobs), in
    fp32."""
    log_p = torch.log_softmax(logits.float() / temperature[:, None], -1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), entropy


def actions_forward(model, input_ids: torch.Tensor, predicts: torch.Tensor,
                    cache: DynamicCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model on right-padded `input_ids`, after the tokens `cache` holds if any (the new keys and values go
    into it), its LM head only on the positions `predicts` marks (each position but the last predicts the next
    token): those positions' last hidden states and logits (in the model's dtype), flat in row order. No attention
    mask: causal attention never lets a real token see the padding after it, and without one SDPA runs its causal
    kernel, not its masked one (SmolLM2's forward and backward on CPU: 0.87-0.92 of the time for 4 rows of ~300
    tokens, ~0.97 for 13 of ~150, side by side)."""
    kept = {}

    def actions_only(decoder, inputs, out):
        kept["states"] = out.last_hidden_state[:, :-1][predicts]  # [response tokens, hidden]: each action's context
        out.last_hidden_state = kept["states"][None]  # the head's input: one row of just those
        return out

    hook = model.get_decoder().register_forward_hook(actions_only)
    try:
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=cache is not None)
    finally:
        hook.remove()
    return kept["states"], out.logits[0]


def collate(micro_batch: MicroBatch, pad_id: int, share_prefix: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response rows. Position i of `mask` predicts token i+1, and is 1 where that token is
    the policy's action; the flat per-token tensors (advantages, weights, served_logprobs, unweighted: whether the
    served one is not the learner's to importance-weight by, a grammar's or drawn at another temperature than the
    one scored at, compared: whether the learner's logprob is the served one's to match, neither those nor a
    nucleus's) follow the actions in row order, as `score` returns them; `row_tokens` and
    `sample_returns` give each row's share and return; `shared`, with share_prefix, how many leading tokens all rows
    have in common (`score` runs them once)."""
    rows = micro_batch or []
    width = max([len(t.prompt_ids) + len(t.response_ids) for t, _ in rows] + [2])
    n = max(len(rows), 1)  # an empty micro-batch is one row of padding: no tokens, zero loss, still a backward
    input_ids = np.full((n, width), pad_id, np.int64)
    mask = np.zeros((n, width - 1), np.float32)
    for i, (t, _) in enumerate(rows):  # the transitions' arrays, copied straight into the batch
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p], input_ids[i, p : p + r] = t.prompt_ids, t.response_ids
        mask[i, p - 1 : p - 1 + r] = t.action_mask  # tool results: context only
    tokens = [t.action_tokens for t, _ in rows]

    def per_action(values: list[float]) -> torch.Tensor:
        return torch.from_numpy(np.repeat(np.array(values, np.float32), tokens))

    served = np.concatenate([np.zeros(0), *(t.logprobs[t.action_mask == 1] for t, _ in rows)], dtype=np.float32)
    scored_at = [t.temperature if t.score_temperature is None else t.score_temperature for t, _ in rows]
    # served logprobs the learner's do not estimate: a grammar's masked ones, or drawn at another temperature
    unweighted = np.repeat([t.constrained or at != t.temperature for (t, _), at in zip(rows, scored_at)],
                           tokens).astype(bool)
    compared = ~unweighted & np.repeat([t.top_p >= 1.0 for t, _ in rows], tokens).astype(bool)
    weights = np.concatenate([np.zeros(0), *(np.broadcast_to(w, t.action_tokens) for t, w in rows)], dtype=np.float32)
    return {"input_ids": torch.from_numpy(input_ids), "mask": torch.from_numpy(mask),
            "temperature": torch.tensor(scored_at or [1.0]),
            "advantages": per_action([t.advantage for t, _ in rows]), "weights": torch.from_numpy(weights),
            "served_logprobs": torch.from_numpy(served), "unweighted": torch.from_numpy(unweighted),
            "compared": torch.from_numpy(compared),
            "row_tokens": tokens,
            "sample_returns": [t.returns for t, _ in rows],
            "shared": shared_prefix([t for t, _ in rows]) if share_prefix else 0}


def shared_prefix(rows: list[Transition]) -> int:
    """How many leading prompt tokens all rows have in common, short of every row's last prompt token (whose
    position predicts the first action, so it stays in each row's own part); 0 for fewer than two rows."""
    if len(rows) < 2:
        return 0
    first, n = rows[0].prompt_ids, min(len(t.prompt_ids) for t in rows) - 1
    for t in rows[1:]:
        differ = np.flatnonzero(np.asarray(t.prompt_ids[:n]) != np.asarray(first[:n]))
        n = int(differ[0]) if len(differ) else n
    return max(n, 0)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
