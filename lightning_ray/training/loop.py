"""The loop inside each Ray Train worker: one long-lived DeepSpeed engine that takes batches, updates the policy
and publishes the new weights. It lives for the whole job: a fit() costs tens of seconds to start."""

from __future__ import annotations

import hashlib
import os

import ray
import ray.train
import torch

from lightning_ray.algorithm.grpo import policy_loss
from lightning_ray.types import Transition


def deepspeed_config(cfg: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,  # batches are variable-sized; DeepSpeed only needs a nominal size
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg["grad_clip"],
        "zero_optimization": {"stage": cfg["zero_stage"]},
        # torch_adam: DeepSpeed's fused CPU Adam would compile for ~70 s on first use.
        "optimizer": {"type": "AdamW", "params": {"lr": cfg["lr"], "weight_decay": cfg["weight_decay"], "torch_adam": True}},
        "steps_per_print": 2**31,
    }


def train_loop_per_worker(cfg: dict) -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", cfg["extensions_dir"])  # DeepSpeed's CPU comm op builds once
    import deepspeed
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    transformers.logging.disable_progress_bar()  # per-load bars from every worker bury the iteration summaries
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32)
    pad_id = AutoTokenizer.from_pretrained(cfg["model_path"]).pad_token_id
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(cfg), dist_init_required=False)
    inbox, outbox, registry = cfg["inboxes"][rank], cfg["outbox"], cfg["registry"]
    version = 0
    outbox.put({"rank": rank, "ready": True, "digest": parameter_digest(engine.module)})
    while (msg := inbox.get()) is not None:
        if msg["kind"] == "save":
            if rank == 0:
                engine.module.save_pretrained(msg["path"])
                AutoTokenizer.from_pretrained(cfg["model_path"]).save_pretrained(msg["path"])
            outbox.put({"rank": rank, "saved": msg["path"]})
            continue
        stats = train_step(engine, msg["transitions"], pad_id, cfg["clip_eps"])
        version += 1
        if rank == 0:
            state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
            ray.get(registry.publish.remote(version, [ray.put(state)]))
        outbox.put({"rank": rank, "version": version, "digest": parameter_digest(engine.module), **stats})


def train_step(engine, transitions: list[Transition], pad_id: int, clip_eps: float) -> dict:
    """One optimizer step on this worker's shard. An empty shard still steps (with zero loss): every rank must
    join the gradient all-reduce."""
    batch = collate(transitions, pad_id)
    logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    loss, stats = policy_loss(logprobs, batch["old_logprobs"], batch["advantages"][:, None], batch["mask"], clip_eps)
    with torch.no_grad():  # how far the trainer's logprobs are from the server's for the same tokens
        tokens = batch["mask"].sum().clamp(min=1)
        stats["logprob_abs_diff"] = ((logprobs - batch["old_logprobs"]).abs() * batch["mask"]).sum().item() / tokens.item()
    engine.backward(loss)
    engine.step()
    return {"loss": loss.item(), "transitions": len(transitions), **stats}


def collate(transitions: list[Transition], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response rows. Position i of the masks predicts token i+1."""
    rows = transitions or []
    width = max([len(t.prompt_ids) + len(t.response_ids) for t in rows] + [2])
    n = max(len(rows), 1)
    input_ids = torch.full((n, width), pad_id)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    mask, old = torch.zeros(n, width - 1), torch.zeros(n, width - 1)
    advantages = torch.zeros(n)
    for i, t in enumerate(rows):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        attention_mask[i, : p + r] = 1
        mask[i, p - 1 : p - 1 + r] = 1
        old[i, p - 1 : p - 1 + r] = torch.tensor(t.logprobs)
        advantages[i] = t.advantage
    return {"input_ids": input_ids, "attention_mask": attention_mask, "mask": mask, "old_logprobs": old,
            "advantages": advantages}


def parameter_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
