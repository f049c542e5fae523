"""The loop inside each Ray Train worker: one long-lived DeepSpeed engine that takes batches, updates the policy
and publishes the new weights. It lives for the whole job: a fit() costs tens of seconds to start."""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch

from lightning_ray.algorithm.grpo import kl_to_reference, policy_loss, truncated_is_weights
from lightning_ray.algorithm.ppo import gae, token_rewards, value_loss, whiten
from lightning_ray.types import Transition

MicroBatch = list[tuple[Transition, float]]  # transitions with the weight of each of their tokens in the loss


def deepspeed_config(cfg: dict, on_cuda: bool) -> dict:
    zero: dict = {"stage": cfg["zero_stage"]}
    if cfg["offload_optimizer"]:  # DeepSpeed's CPU Adam then steps on the host (compiled once, ~1 min)
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    # torch_adam: DeepSpeed's fused CPU Adam would compile for ~70 s on first use; on CUDA torch's fused kernel.
    adam = {"lr": cfg["lr"], "weight_decay": cfg["weight_decay"], "torch_adam": not cfg["offload_optimizer"],
            **({"fused": True} if on_cuda and not cfg["offload_optimizer"] else {})}
    return {
        "train_micro_batch_size_per_gpu": 1,  # batches are variable-sized; DeepSpeed only needs a nominal size
        # We accumulate over as many micro-batches as a batch needs (its token budget decides) and step once:
        # backward() only accumulates, step() is the boundary. Losses come pre-weighted (grpo.token_weights).
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg["grad_clip"],
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": adam},
        # bf16 compute; fp32 master weights and optimizer state (ZeRO's, stage >= 1: learner.zero_stage), and
        # gradients accumulated over the micro-batches in fp32
        "bf16": {"enabled": cfg["dtype"] == "bfloat16"},
        **({"data_types": {"grad_accum_dtype": "fp32"}} if cfg["dtype"] == "bfloat16" else {}),
        "steps_per_print": 2**31,
    }


def clear_stale_build_locks(extensions_dir: str, max_age_s: float = 900) -> list[Path]:
    """Delete op-build locks older than any build takes (~1 min here). torch waits on a lock as long as it exists, so
    a build killed half-way would leave every later learner waiting forever, silently."""
    now, stale = time.time(), []
    for lock in Path(extensions_dir).glob("*/lock"):
        with suppress(FileNotFoundError):
            if now - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                stale.append(lock)
                print(f"deleted a stale DeepSpeed build lock (a build killed half-way): {lock}", flush=True)
    return stale


def train_loop_per_worker(cfg: dict) -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", cfg["extensions_dir"])  # DeepSpeed's CPU comm op builds once
    clear_stale_build_locks(os.environ["TORCH_EXTENSIONS_DIR"])
    import deepspeed
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg["threads_per_worker"])
    transformers.logging.disable_progress_bar()  # per-load bars from every worker bury the iteration summaries
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()  # this rank's GPU (Ray Train set it), or the CPU
    on_cuda = device.type == "cuda"
    load = dict(dtype=getattr(torch, cfg["dtype"]), attn_implementation=cfg["attn_implementation"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], **load)
    if cfg["gradient_checkpointing"] is True or (cfg["gradient_checkpointing"] == "auto" and on_cuda):
        # non-reentrant: works with inputs that need no grad and with ZeRO-3's parameter hooks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    # Train mode for checkpointing (transformers recomputes only in training), dropout off: a sampled token is
    # scored as the engine sampled it, without dropout noise
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):  # attention's own, applied in training only
            m.attention_dropout = 0.0
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # padding is masked out anyway
    # the frozen initial policy, kept only when the loss pulls towards it, on the rank's device in its dtype
    reference = None
    if cfg["kl_coef"] > 0:
        reference = AutoModelForCausalLM.from_pretrained(cfg["model_path"], **load).to(device).eval()
        reference.requires_grad_(False)
    parameters = [{"params": list(model.parameters())}]
    if cfg["critic"]:
        model = WithValueHead(model)
        parameters.append({"params": list(model.value_head.parameters()), "lr": cfg["value_lr"] or cfg["lr"]})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters,
                                      config=deepspeed_config(cfg, on_cuda), dist_init_required=False)
    inbox, outbox, registry = cfg["inboxes"][rank], cfg["outbox"], cfg["registry"]
    from lightning_ray.weight_sync import make_publisher

    # rank 0 publishes each version, by the run's transport (object store, CUDA IPC, or a broadcast it serves)
    publisher = make_publisher(cfg["weight_sync"], registry, engine.device) if rank == 0 else None
    with whole_weights(engine) as module:
        outbox.put({"rank": rank, "ready": True, "digest": parameter_digest(module)})
    while (msg := inbox.get()) is not None:
        if msg["kind"] == "save":
            with whole_weights(engine) as module:
                if rank == 0:
                    module.save_pretrained(msg["path"])  # the policy (a critic's value head is the run's own)
                    tokenizer.save_pretrained(msg["path"])
            outbox.put({"rank": rank, "saved": msg["path"]})
            continue
        started = time.perf_counter()
        stats = train_step(engine, msg["micro_batches"], pad_id, cfg, world, reference)
        trained = time.perf_counter()
        with whole_weights(engine) as module:
            if rank == 0:  # copied here: ZeRO-3 frees the gathered parameters when the block ends
                ray.get(registry.publish.remote(msg["version"], publisher.publish(msg["version"], module)))
            published = time.perf_counter()
            digest = parameter_digest(module)
        if on_cuda:  # activations and gradients' cached blocks back to the GPU, for a colocated engine to wake into
            torch.cuda.empty_cache()
        stats.update(compute_s=trained - started, publish_s=published - trained,
                     digest_s=time.perf_counter() - published)
        outbox.put({"rank": rank, "version": msg["version"], "digest": digest, **stats})


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


@contextmanager
def whole_weights(engine):
    """The policy with all its parameters whole for the block: ZeRO-3 keeps a shard of each on every rank, and
    gathering them is a collective (every rank enters). Other stages keep them whole: nothing to do."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=engine.zero_optimization_partition_weights()):
        yield policy_of(engine.module)


def train_step(engine, micro_batches: list[MicroBatch], pad_id: int, cfg: dict, world_size: int,
               reference: torch.nn.Module | None = None) -> dict:
    """One optimizer step over this rank's micro-batches, gradients accumulated. Every rank gets the same number
    of micro-batches (some may be empty): ZeRO reduces gradients inside backward, and all ranks must join.

    The batch is on-policy (sampled by exactly these weights) and takes one step, so the behaviour policy's
    logprobs are the ones computed here, detached: the ratio starts at 1, as PPO's first step does. Where the
    sampler differed after all (an older version, the engine's numerics), tis_cap reweighs each token."""
    batches = [to_device(collate(mb, pad_id), engine.device) for mb in micro_batches]
    totals = {"loss": 0.0, "tokens": 0, "clip_frac": 0.0, "logprob_abs_diff": 0.0, "entropy": 0.0, "kl_ref": 0.0,
              "value_loss": 0.0, "tis_capped": 0.0}
    if cfg["critic"]:  # PPO: every token's advantage from the value head, before any weight moves
        totals["kl_ref"] += critic_advantages(engine.module, batches, cfg, reference)
    for batch in batches:
        scores = score(engine.module, batch, entropy_grad=cfg["entropy_coef"] > 0)
        # DeepSpeed averages gradients over ranks; the weights already normalize over the whole batch.
        weights = batch["weights"] * world_size
        is_weights = None
        if cfg["tis_cap"]:
            is_weights = truncated_is_weights(scores.untempered, batch["served_logprobs"], cfg["tis_cap"])
            totals["tis_capped"] += (is_weights >= cfg["tis_cap"]).sum().item()
        loss, stats = policy_loss(scores.logprobs, scores.logprobs.detach(), batch["advantages"], weights,
                                  cfg["clip_eps"], cfg["clip_eps_high"], is_weights)
        loss = loss - cfg["entropy_coef"] * (scores.entropy * weights).sum()
        if scores.values is not None:
            critic_loss = value_loss(scores.values, batch["returns"], batch["weights"])
            loss = loss + cfg["value_coef"] * critic_loss * world_size
            totals["value_loss"] += critic_loss.item()
        if reference is not None and cfg["kl_penalty"] == "loss":
            with torch.no_grad():
                ref_logprobs = score(reference, batch).logprobs
            kl = kl_to_reference(scores.logprobs, ref_logprobs, cfg["kl_estimator"])
            loss = loss + cfg["kl_coef"] * (kl * weights).sum()
            totals["kl_ref"] += kl.detach().sum().item()
        engine.backward(loss, scale_wrt_gas=False)
        n = len(scores.logprobs)
        totals["loss"] += loss.item() / world_size
        totals["tokens"] += n
        totals["clip_frac"] += stats["clip_frac"] * n
        totals["entropy"] += scores.entropy.detach().sum().item()
        # how far the trainer is from the server on the same tokens (both untempered): ~1e-7 when they agree
        totals["logprob_abs_diff"] += (scores.untempered - batch["served_logprobs"]).abs().sum().item()
    stepped = time.perf_counter()
    grad_norm = None
    if engine.zero_optimization_stage() == 0:  # DeepSpeed reports the norm only from its ZeRO optimizers
        grads = [p.grad.norm() for p in engine.module.parameters() if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack(grads)).item() if grads else 0.0
    engine.step()
    optimizer_s = time.perf_counter() - stepped
    tokens = max(totals["tokens"], 1)
    grad_norm = engine.get_global_grad_norm() or grad_norm  # before clipping (DeepSpeed computes it to clip)
    return {"optimizer_s": optimizer_s, "loss": totals["loss"], "value_loss": totals["value_loss"],
            "tokens": totals["tokens"], "micro_batches": len(micro_batches),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            **{k: totals[k] / tokens for k in ("clip_frac", "logprob_abs_diff", "entropy", "kl_ref", "tis_capped")}}


def critic_advantages(module: torch.nn.Module, batches: list[dict], cfg: dict,
                      reference: torch.nn.Module | None) -> float:
    """PPO (algorithm/ppo.py): each sample's token rewards, GAE against the value head's estimates, advantages
    whitened over the whole batch; written into the batches as their `advantages` and `returns` (value targets).
    Returns the summed KL to the reference where it is a reward penalty (0 otherwise)."""
    kl_sum = 0.0
    with torch.no_grad():
        for batch in batches:
            scores = score(module, batch)
            kl = None
            if reference is not None and cfg["kl_penalty"] == "reward":
                kl = kl_to_reference(scores.logprobs, score(reference, batch).logprobs, cfg["kl_estimator"])
                kl_sum += kl.sum().item()
            advantages, targets, start = [], [], 0
            for tokens, sample_return in zip(batch["row_tokens"], batch["sample_returns"]):
                end = start + tokens
                rewards = token_rewards(sample_return, tokens, None if kl is None else kl[start:end], cfg["kl_coef"])
                a, r = gae(rewards, scores.values[start:end], cfg["gae_lambda"])
                advantages.append(a)
                targets.append(r)
                start = end
            empty = torch.zeros(0, device=scores.values.device)
            batch["advantages"] = torch.cat(advantages) if advantages else empty
            batch["returns"] = torch.cat(targets) if targets else empty
    whitened = whiten(torch.cat([b["advantages"] for b in batches])).split([len(b["advantages"]) for b in batches])
    for batch, a in zip(batches, whitened):
        batch["advantages"] = a
    return kl_sum


class Scores(NamedTuple):
    logprobs: torch.Tensor  # under each call's sampling temperature (with gradient)
    untempered: torch.Tensor  # to compare with the engine's
    entropy: torch.Tensor  # of each position's sampling distribution
    values: torch.Tensor | None  # the value head's estimate at each position (a critic's module only)


def score(module: torch.nn.Module, batch: dict[str, torch.Tensor], entropy_grad: bool = False) -> Scores:
    """Per response token, flat in row order: its logprob under the call's sampling temperature (with gradient)
    and untempered; the entropy of the position's sampling distribution (with gradient for an entropy bonus); a
    critic's value estimate. Only the positions that predict a response token go through the LM head, so the
    [rows, width, vocabulary] logits of the whole micro-batch never exist."""
    model = policy_of(module)
    hidden = model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    predicts = batch["mask"].bool()
    states = hidden[:, :-1][predicts]  # [response tokens, hidden]: the context each action was taken in
    logits = model.get_output_embeddings()(states).float()  # [response tokens, vocabulary]
    targets = batch["input_ids"][:, 1:][predicts]
    temperature = batch["temperature"][:, None].expand_as(predicts)[predicts]
    picked = logits.gather(-1, targets[:, None]).squeeze(-1)
    tempered = picked / temperature - torch.logsumexp(logits / temperature[:, None], -1)
    with torch.no_grad():
        untempered = picked - torch.logsumexp(logits, -1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        log_p = torch.log_softmax(logits / temperature[:, None], -1)
        entropy = -(log_p.exp() * log_p).sum(-1)
    values = module.value_head(states).squeeze(-1).float() if isinstance(module, WithValueHead) else None
    return Scores(tempered, untempered, entropy, values)


def collate(micro_batch: MicroBatch, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response rows. Position i of `mask` predicts token i+1, and is 1 where that token is
    the policy's action; the flat per-token tensors (advantages, weights, served_logprobs) follow the actions in row
    order, as `score` returns them; `row_tokens` and `sample_returns` give each row's share and return."""
    rows = micro_batch or []
    width = max([len(t.prompt_ids) + len(t.response_ids) for t, _ in rows] + [2])
    n = max(len(rows), 1)  # an empty micro-batch is one row of padding: no tokens, zero loss, still a backward
    input_ids = np.full((n, width), pad_id, np.int64)
    attention_mask = np.zeros((n, width), np.int64)
    mask = np.zeros((n, width - 1), np.float32)
    for i, (t, _) in enumerate(rows):  # the transitions' arrays, copied straight into the batch
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p], input_ids[i, p : p + r] = t.prompt_ids, t.response_ids
        attention_mask[i, : p + r] = 1
        mask[i, p - 1 : p - 1 + r] = t.action_mask  # tool results: context only
    tokens = [t.action_tokens for t, _ in rows]

    def per_action(values: list[float]) -> torch.Tensor:
        return torch.from_numpy(np.repeat(np.array(values, np.float32), tokens))

    served = np.concatenate([np.zeros(0), *(t.logprobs[t.action_mask == 1] for t, _ in rows)], dtype=np.float32)
    return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
            "mask": torch.from_numpy(mask), "temperature": torch.tensor([t.temperature for t, _ in rows] or [1.0]),
            "advantages": per_action([t.advantage for t, _ in rows]), "weights": per_action([w for _, w in rows]),
            "served_logprobs": torch.from_numpy(served), "row_tokens": tokens,
            "sample_returns": [t.returns for t, _ in rows]}


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def parameter_digest(module: torch.nn.Module) -> str:
    """A fingerprint of the parameters' values, equal wherever they are equal: across ranks, in a checkpoint, in an
    engine, in any dtype that holds them exactly (each value is taken as its float32 bits). Computed where the
    parameters are, so only one integer per tensor leaves a GPU."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(_bits_checksum(p.detach()).to_bytes(8, "little", signed=True))
    return h.hexdigest()[:16]


def _bits_checksum(t: torch.Tensor, chunk: int = 1 << 24) -> int:
    """Σ bits(x_i) · (i + 1) over the float32 bit patterns, in wrapping int64: exact integer arithmetic, so the same
    on every device and in any summation order; the position weight tells permutations apart."""
    flat, total = t.reshape(-1), torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, flat.numel(), chunk):
        bits = flat[start:start + chunk].float().view(torch.int32).to(torch.int64)
        total += (bits * torch.arange(start + 1, start + 1 + bits.numel(), device=t.device)).sum()
    return int(total)
