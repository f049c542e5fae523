"""The loop inside each Ray Train worker: one long-lived DeepSpeed engine that takes batches, updates the policy
and publishes the new weights. It lives for the whole job: a fit() costs tens of seconds to start."""

from __future__ import annotations

import math
import os
import resource
import time
import traceback
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from lightning_ray.algorithm.loss import kl_to_reference, policy_loss, truncated_is_weights
from lightning_ray.algorithm.ppo import gae, token_rewards, value_loss, whiten
from lightning_ray.config import AlgorithmConfig, LearnerConfig
from lightning_ray.learner import lora, memory
from lightning_ray.learner.digest import parameter_digest
from lightning_ray.learner.scoring import MicroBatch, WithValueHead, collate, policy_of, score, to_device
from lightning_ray.weight_sync.adapter import DEFAULT


def deepspeed_config(t: LearnerConfig, on_cuda: bool) -> dict:
    """`t`: the learner's settings with `auto` resolved (learner.resolved)."""
    zero: dict = {"stage": t.zero_stage}
    if t.offload_optimizer:  # DeepSpeed's CPU Adam then steps on the host (compiled once, ~1 min)
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    # torch_adam: DeepSpeed's fused CPU Adam would compile for ~70 s on first use; on CUDA torch's fused kernel.
    adam = {"lr": t.lr, "weight_decay": t.weight_decay, "torch_adam": not t.offload_optimizer,
            **({"fused": True} if on_cuda and not t.offload_optimizer else {})}
    bf16 = t.dtype == "bfloat16"
    return {
        "train_micro_batch_size_per_gpu": 1,  # batches are variable-sized; DeepSpeed only needs a nominal size
        # We accumulate over as many micro-batches as a mini-batch needs (its token budget decides) and step once:
        # backward() only accumulates, step() is the boundary. Losses come pre-weighted (loss.token_weights).
        "managed_gradient_accumulation": False,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": adam},
        # bf16 compute; fp32 master weights and optimizer state (ZeRO's, stage >= 1: learner.zero_stage), and
        # gradients accumulated over the micro-batches in fp32
        # check_grad_overflow: a step whose gradient is not finite is skipped (optimizer_step); immediate_grad_update:
        # each bf16 gradient added into the fp32 ones as the backward makes it, and freed (not kept, cleared and
        # added at the end of each backward: a model's worth of bf16 gradients less, ~10 ms a micro-batch fewer)
        "bf16": {"enabled": bf16, "check_grad_overflow": True, "immediate_grad_update": bf16},
        **({"data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {}),
        # ZeRO-1's bf16 optimizer reduces the fp32-accumulated gradients in the compute dtype by default, one rank
        # or several: rounded to bf16's grid before clipping and Adam
        **({"communication_data_type": "fp32"} if bf16 and t.zero_stage <= 1 else {}),
        "timers": {"throughput": {"enabled": False}},  # its timer synchronizes the GPU at every forward
        "steps_per_print": 2**31,
    }


def deepspeed_engine(model: torch.nn.Module, parameters: list[dict], t: LearnerConfig, on_cuda: bool):
    """DeepSpeed's engine for `model`, on the rank's process group (Ray Train's)."""
    import deepspeed

    # DeepSpeed's torch backend would build a shared-memory all-reduce op at its first start (C++: ~1 min, and a
    # compiler on the machine) that only inference's tensor parallelism calls; training's collectives are
    # torch.distributed's. deepspeed/ops/__init__.py keeps this dict for such edits.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters, config=deepspeed_config(t, on_cuda),
                                      dist_init_required=False)
    return engine


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


OUT_OF_MEMORY = ("the learner ran out of GPU memory: lower learner.micro_batch_tokens (each micro-batch's tokens), "
                 "keep learner.gradient_checkpointing on, share the states over more ranks (learner.zero_stage=3) or "
                 "keep the optimizer on the host (learner.offload_optimizer=true), or train LoRA adapters "
                 "(learner.lora={}); colocated, the engine's share is engine.gpu_memory_utilization, freed while the "
                 "learner trains with engine.sleep_while_training=true")


def train_loop_per_worker(cfg: dict) -> None:
    """One rank (learn); an error in it goes to the driver before Ray Train sees it, so the run fails at once with
    it rather than restarting the ranks into the same error (restarts are for ranks that die: the driver tells the
    error of a rank whose collective broke because another died from its own)."""
    nonce = uuid.uuid4().hex  # this process
    try:
        learn(cfg, nonce)
    except Exception as e:
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e):  # cuBLAS, NCCL: RuntimeErrors
            # the same batch would run out again on a restart or a resume
            e.add_note(OUT_OF_MEMORY)
        with suppress(Exception):
            cfg["outbox"].put({"rank": ray.train.get_context().get_world_rank(), "nonce": nonce,
                               "error": "".join(traceback.format_exception(e))})
        raise


def learn(cfg: dict, nonce: str) -> None:
    """`cfg`: the learner's settings (`learner`, `auto` resolved) and the algorithm's, typed, beside the run's model
    path (the initial policy: the KL reference), queues, registry and weight transport (learner/driver.py).

    Ray Train may run this more than once on a rank: when a rank's process dies it restarts every rank
    (learner.max_restarts). So each start announces itself with a nonce and takes no command before the driver
    attaches it (naming the checkpoint to load): commands queued for the process before it, and its replies once
    another has replaced it, are told apart by the nonce."""
    t, alg = cfg["learner"], cfg["algorithm"]
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", cfg["extensions_dir"])  # CPU Adam (offload_optimizer) builds once
    clear_stale_build_locks(os.environ["TORCH_EXTENSIONS_DIR"])
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(t.threads_per_worker)
    transformers.logging.disable_progress_bar()  # per-load bars from every worker bury the iteration summaries
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()  # this rank's GPU (Ray Train set it), or the CPU
    on_cuda = device.type == "cuda"
    load = dict(dtype=getattr(torch, t.dtype), attn_implementation=t.attn_implementation)
    # LoRA: one adapter, or one per agent (algorithm.adapters), each its own parameter group (learning rate)
    adapters = list(alg.adapters or [DEFAULT]) if t.lora else []
    model = trainable_policy(AutoModelForCausalLM.from_pretrained(cfg["model_path"], **load), t, adapters)
    memory.check_fits(model, device, world, t.zero_stage, t.offload_optimizer, reference=not t.lora and alg.kl_coef > 0)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # padding is masked out anyway
    # the frozen initial policy, kept only when the loss pulls towards it, on the rank's device in its dtype (with
    # LoRA the base itself, the adapter off)
    reference = None
    if t.lora:
        reference = lora.AdapterOff(model) if alg.kl_coef > 0 else None
    elif alg.kl_coef > 0:
        reference = AutoModelForCausalLM.from_pretrained(cfg["model_path"], **load).to(device).eval()
        reference.requires_grad_(False)
    parameters = parameter_groups(model, adapters)
    if alg.estimator == "ppo":  # a critic: the value head
        model = WithValueHead(model)
        parameters.append({"params": list(model.value_head.parameters()), "lr": alg.value_lr or t.lr})
    engine = deepspeed_engine(model, parameters, t, on_cuda)
    inbox, outbox, registry = cfg["inboxes"][rank], cfg["outbox"], cfg["registry"]
    from lightning_ray.weight_sync import make_publisher

    # rank 0 publishes each version, by the run's transport (object store, CUDA IPC, a broadcast it serves, or with
    # LoRA the adapter alone)
    publisher = None if rank else make_publisher(cfg["weight_sync"], registry, engine.device)
    outbox.put({"rank": rank, "ready": True, "nonce": nonce, "pid": os.getpid(),
                "actor": ray.get_runtime_context().current_actor})
    while (msg := inbox.get()) is not None and not (msg["kind"] == "attach" and msg["nonce"] == nonce):
        pass  # sent to the process this one replaces
    if msg is None:
        return
    if msg["load"]:  # a resumed run or a restarted rank: the checkpoint's weights, optimizer state and value head
        load_state(engine, Path(msg["load"]) / "learner", adapters, [g.get("lr", t.lr) for g in parameters])
    if msg["publish"]:  # restarted ranks: the weights they went back to, as a new version (learner/driver.py)
        with whole_weights(engine) as module:
            if rank == 0:
                publish(registry, publisher, msg["publish"], served(module))
    outbox.put({"rank": rank, "nonce": nonce, "attached": msg["load"]})
    # learner.max_logprob_gap is checked at the run's first step: a restarted rank's first batch was sampled by
    # weights newer than the checkpoint it went back to, so a gap there is the updates since, not a mismatch
    first = not msg["publish"]
    while (msg := inbox.get()) is not None:
        if msg["kind"] == "save":  # learner/checkpoint.py's layout
            with whole_weights(engine) as module:
                if rank == 0:  # a critic's value head is the run's own; an adapter is saved also on its own
                    served(module).save_pretrained(Path(msg["path"]) / "policy")
                    tokenizer.save_pretrained(Path(msg["path"]) / "policy")
                    if t.lora:
                        module.save_pretrained(Path(msg["path"]) / "adapter")
            save_state(engine, Path(msg["path"]) / "learner", adapters)
            outbox.put({"rank": rank, "nonce": nonce, "saved": msg["path"]})
            continue
        started = time.perf_counter()
        stats = train_step(engine, msg["mini_batches"], pad_id, alg, world, reference,
                           t.max_logprob_gap if first else None, msg["adapters"] if alg.adapters else None,
                           t.shared_prefix)
        first = False
        trained = time.perf_counter()
        with whole_weights(engine) as module:
            policy = served(module)
            # Before publishing, not beside the replicas' load of the weights (SmolLM2, 2 cores: 0.15 s against 2-5 s;
            # the update no shorter, the barrier waiting for that load). Per agent: the base and every adapter.
            digest = parameter_digest(module if alg.adapters else policy)
            digested = time.perf_counter()
            # the step's cached blocks back to the GPU before the publish wakes a colocated engine into them (where
            # none does, the next step reuses them)
            if on_cuda and cfg.get("engine_wakes_beside"):
                torch.cuda.empty_cache()
            # copied here: ZeRO-3 frees the gathered parameters when the block ends. Weights that no step moved
            # (each was skipped) are no new version.
            if rank == 0 and stats["updated"]:
                publish(registry, publisher, msg["version"], policy)
        stats.update(compute_s=trained - started, digest_s=digested - trained,
                     publish_s=time.perf_counter() - digested, peak_mib=peak_mib(device))
        outbox.put({"rank": rank, "nonce": nonce, "version": msg["version"], "digest": digest, **stats})


def save_state(engine, path: Path, adapters: list[str]) -> None:
    """Every rank its share: weights, optimizer state (ZeRO's partitions), the value head. With LoRA (`adapters`,
    in their parameter groups' order) the trained weights only: the frozen base is the run's model.path, loaded at
    every start (kept, DeepSpeed's ZeRO-2 and 3 would have every rank copy it to host memory at each save, on GPUs,
    and write it twice)."""
    engine.save_checkpoint(str(path), tag="state", save_latest=False, exclude_frozen_parameters=bool(adapters),
                           client_state={"adapters": adapters})


def load_state(engine, path: Path, adapters: list[str], rates: list[float]) -> None:
    """What save_state saved, at this run's learning rates (`rates`, one per parameter group): the optimizer's load
    would bring back the saved run's, and a resumed run with another learner.lr or algorithm.value_lr would
    silently go on at the old ones."""
    loaded, saved = engine.load_checkpoint(str(path), tag="state",
                                           custom_load_fn=_all_but_the_base if adapters else None)
    if loaded is None:  # DeepSpeed only warns
        raise FileNotFoundError(f"no learner state to load in {path}")
    if saved.get("adapters", adapters) != adapters:  # the optimizer's groups are matched by their order alone
        raise ValueError(f"the checkpoint's learner trained the adapters {saved['adapters']}, in that order; this "
                         f"run's algorithm.adapters (learner.lora) gives {adapters}: resume with the same")
    for group, lr in zip(engine.optimizer.param_groups, rates, strict=True):
        group["lr"] = lr
        group.pop("trained_lr", None)  # trained_only's record of it


def _all_but_the_base(src: dict, dst: torch.nn.Module) -> None:
    """A LoRA checkpoint's weights into the learner: what it holds must fit, and lack only the frozen base."""
    result = dst.load_state_dict(src, strict=False)
    frozen = {n for n, p in dst.named_parameters(remove_duplicate=False) if not p.requires_grad}
    missing = set(result.missing_keys) - frozen
    if missing or result.unexpected_keys:
        raise RuntimeError(f"the checkpoint's learner state does not fit this learner (another learner.lora or "
                           f"algorithm.adapters?): missing {sorted(missing)[:4]}, unexpected "
                           f"{result.unexpected_keys[:4]}")


def trainable_policy(model: torch.nn.Module, t: LearnerConfig, adapters: list[str]) -> torch.nn.Module:
    """The loaded policy as the learner trains it: with its adapters (learner.lora), activation checkpointing where
    `t` says (resolved by the driver: `auto` is on with GPUs), in train mode without dropout."""
    if t.lora:
        model = lora.with_adapter(model, t.lora, adapters)
    if t.gradient_checkpointing:
        # non-reentrant: works with inputs that need no grad and with ZeRO-3's parameter hooks. So the hook
        # transformers puts on the embeddings here (their output to need a gradient, as reentrant checkpointing
        # does) comes off: it would carry the backward down through every frozen layer below the lowest adapted
        # one (learner.lora.layers) for nothing. (Enabled after peft, which would put one more.)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.disable_input_require_grads()
        model.config.use_cache = False
    # Train mode for checkpointing (transformers recomputes only in training), dropout off: a sampled token is
    # scored as the engine sampled it, without dropout noise
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):  # attention's own, applied in training only
            m.attention_dropout = 0.0
    return model


def parameter_groups(model: torch.nn.Module, adapters: list[str]) -> list[dict]:
    """The optimizer's parameter groups: one per LoRA adapter, in `adapters`' order (trained_only sets each one's
    learning rate), else every trainable parameter."""
    return [{"params": lora.adapter_parameters(model, name)} for name in adapters] or \
        [{"params": [p for p in model.parameters() if p.requires_grad]}]


def publish(registry, publisher, version: int, policy: torch.nn.Module) -> None:
    """Rank 0's: the version's payload by the run's transport, then the registry tells the replicas."""
    ray.get(registry.publish.remote(version, publisher.publish(version, policy)))


def served(policy: torch.nn.Module):
    """The policy as the engines load it: with LoRA, the adapter merged into the base's weights."""
    return lora.Merged(policy) if lora.is_adapted(policy) else policy


@contextmanager
def whole_weights(engine):
    """The policy with all its parameters whole for the block: ZeRO-3 keeps a shard of each on every rank, and
    gathering them is a collective (every rank enters). Other stages keep them whole: nothing to do."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=engine.zero_optimization_partition_weights()):
        yield policy_of(engine.module)


def train_step(engine, mini_batches: list[list[MicroBatch]], pad_id: int, alg: AlgorithmConfig, world_size: int,
               reference: torch.nn.Module | None = None, max_logprob_gap: float | None = None,
               adapters: list[list[str | None]] | None = None, share_prefix: bool = False) -> dict:
    """This rank's share of a batch: one optimizer step per mini-batch, gradients accumulated over its
    micro-batches, and all of it algorithm.ppo_epochs times. Every rank gets the same number of mini-batches, and of
    micro-batches in each (some may be empty): ZeRO reduces gradients inside backward, and all ranks must join.

    The batch is on-policy (sampled by exactly these weights), so the behaviour policy's logprobs are the ones
    computed here before the first update: the ratio starts at 1, as PPO's first step does, and moves from the
    second step on, where the clip acts. Where the sampler differed after all (an older version, the engine's
    numerics), tis_cap reweighs each token. max_logprob_gap (learner's, on the first batch): fail before any update
    if the learner's logprobs are further than that from the server's. adapters (algorithm.adapters): per mini-batch,
    the adapter each micro-batch runs with (`score`; the same on every rank: learner/driver.py micro_batch_adapters);
    an adapter with no call in a step keeps its weights (its group's learning rate 0 for the step: Adam would move
    it by its momentum; its moments still decay, as under a zero gradient). share_prefix (learner.shared_prefix):
    each micro-batch's common prompt prefix runs once (`score`)."""
    steps = [[to_device(collate(mb, pad_id, share_prefix), engine.device) for mb in mini] for mini in mini_batches]
    for m, mini in enumerate(steps if adapters else []):
        for batch, adapter in zip(mini, adapters[m]):
            batch["adapter"] = adapter
    batches = [b for mini in steps for b in mini]
    tokens = sum(len(b["served_logprobs"]) for b in batches)
    # summed on the device and read once at the end: a .item() per micro-batch would make the CPU wait for the GPU
    # to drain before it queues the next kernels
    totals = {k: torch.zeros((), dtype=torch.float64, device=engine.device)
              for k in ("loss", "value_loss", "clip_frac", "entropy", "kl_ref", "tis_capped")}
    # PPO: every token's advantage from the value head, before any weight moves
    critic = alg.estimator == "ppo"
    critic_kl = critic_advantages(engine.module, batches, alg, reference) if critic else 0.0
    # the old policy, for the steps after the first (the first's comes with its own forward; PPO's every one with the
    # critic's pass)
    with torch.no_grad():
        for batch in (b for mini in steps[1:] for b in mini if "old_logprobs" not in b):
            batch["old_logprobs"] = score(engine.module, batch).logprobs
    norms, optimizer_s = [], 0.0
    for epoch in range(alg.ppo_epochs):
        for m, mini in enumerate(steps):
            for batch in mini:
                micro_step(engine)
                scores = score(engine.module, batch, entropy_grad=alg.entropy_coef > 0)
                if "old_logprobs" not in batch:  # the first step: no weight has moved yet
                    batch["old_logprobs"] = scores.logprobs.detach()
                # DeepSpeed averages gradients over ranks; the weights already normalize over the whole mini-batch.
                weights = batch["weights"] * world_size
                is_weights = None
                if alg.tis_cap:  # sampler → old policy; the ratio takes it on from there (a grammar's: unknown)
                    is_weights = truncated_is_weights(batch["old_logprobs"], batch["served_logprobs"], alg.tis_cap)
                    is_weights = torch.where(batch["unweighted"], 1.0, is_weights)
                    if epoch == 0:
                        totals["tis_capped"] += (is_weights >= alg.tis_cap).sum()
                loss, stats = policy_loss(scores.logprobs, batch["old_logprobs"], batch["advantages"], weights,
                                          alg.clip_eps, alg.clip_eps_high, is_weights)
                loss = loss - alg.entropy_coef * (scores.entropy * weights).sum()
                if scores.values is not None:
                    critic_loss = value_loss(scores.values, batch["returns"], batch["weights"])
                    loss = loss + alg.value_coef * critic_loss * world_size
                    totals["value_loss"] += critic_loss.detach()
                if reference is not None and alg.kl_penalty == "loss":
                    if "ref_logprobs" not in batch:
                        with torch.no_grad():
                            batch["ref_logprobs"] = score(reference, batch).logprobs
                    kl = kl_to_reference(scores.logprobs, batch["ref_logprobs"], alg.kl_estimator)
                    loss = loss + alg.kl_coef * (kl * weights).sum()
                    totals["kl_ref"] += kl.detach().sum()
                totals["loss"] += loss.detach() / world_size
                # a non-finite loss makes every gradient NaN, so the step is skipped (a clipped token's would be 0);
                # on the device: 0 × the logprobs' gradient otherwise
                poison = torch.where(torch.isfinite(loss.detach()), 0.0, math.nan)
                engine.backward(loss + poison * scores.logprobs.sum(), scale_wrt_gas=False)
                totals["clip_frac"] += stats["clip_frac"] * len(scores.logprobs)
                totals["entropy"] += scores.entropy.detach().sum()
            if epoch == m == 0:  # every old logprob is known, and no weight has moved yet
                # how far the trainer is from the server on the same tokens, both at the call's temperature: ~1e-7
                # when they agree; a grammar's or a nucleus's renormalized logprobs are not the trainer's to match.
                # Summed on the device (a boolean index would wait for the GPU), read with the totals
                gap = torch.stack([sum(torch.where(b["compared"], (b["old_logprobs"] - b["served_logprobs"]).abs(), 0)
                                       .sum() for b in batches).double(),
                                   sum(b["compared"].sum() for b in batches).double()])
                totals["logprob_gap"] = gap.clone()  # before the ranks' sum (the check's)
                if max_logprob_gap is not None:
                    check_logprob_gap(gap, max_logprob_gap, world_size)
            stepped = time.perf_counter()
            if adapters:
                trained_only(engine, list(alg.adapters), set(adapters[m]))
            norms.append(optimizer_step(engine, world_size))
            optimizer_s += time.perf_counter() - stepped
    skipped = sum(not applied for _, applied in norms)
    totals = {k: v.tolist() if torch.is_tensor(v) else v for k, v in totals.items()}  # the step's one read
    gap, compared = totals["logprob_gap"]
    updates, per_token = max(tokens * alg.ppo_epochs, 1), max(tokens, 1)
    return {"optimizer_s": optimizer_s, "loss": totals["loss"] / len(norms),
            "value_loss": totals["value_loss"] / len(norms), "tokens": tokens, "micro_batches": len(batches),
            "steps": len(norms), "skipped_nonfinite": skipped, "updated": skipped < len(norms),
            "grad_norm": sum(n for n, _ in norms) / len(norms),  # each before clipping
            "clip_frac": totals["clip_frac"] / updates, "entropy": totals["entropy"] / updates,
            "kl_ref": critic_kl / per_token + totals["kl_ref"] / updates,
            # None: no token to compare (every call a grammar's or drawn within a nucleus)
            "logprob_abs_diff": gap / compared if compared else None, "tis_capped": totals["tis_capped"] / per_token}


def micro_step(engine) -> None:
    """What DeepSpeed's engine.forward does for the backward to come, for `score`, which runs the module itself.
    ZeRO counts a micro-step: ZeRO-3 copies the first micro-step's gradient partitions and adds the later ones;
    uncounted, every micro-batch would overwrite the one before. And the optimizer's backward prologue (a hook on
    the forward's output there): bf16's clears the bf16 gradients it has added into its fp32 ones; uncleared, each
    backward added every micro-batch before it again, the first of n counted n times (the gradient's norm 2.1x for
    3 micro-batches: benchmarks/results/bf16_cpu.json)."""
    if hasattr(engine.optimizer, "clear_backward_seen_flag"):  # ZeRO's optimizers, bf16's among them
        engine.optimizer.clear_backward_seen_flag()
        engine.optimizer.backward_prologue()


def trained_only(engine, names: list[str], trained: set[str]) -> None:
    """The next step moves only the adapters in `trained`: the parameter groups follow `names` (the value head's,
    if any, after them), and the others' learning rate is 0 for it."""
    for group, name in zip(engine.optimizer.param_groups, names):
        group.setdefault("trained_lr", group["lr"])
        group["lr"] = group["trained_lr"] if name in trained else 0.0


def check_logprob_gap(gap: torch.Tensor, max_gap: float, world_size: int) -> None:
    """gap: this rank's summed |learner − served| logprob and its token count. Every rank raises, or none:
    a step some ranks took without the others would wait for them forever."""
    if world_size > 1:
        dist.all_reduce(gap)
    mean = gap[0].item() / max(gap[1].item(), 1)
    if mean > max_gap:
        raise ValueError(f"the learner's logprobs of the sampled tokens differ from the server's by {mean:.3g} per "
                         f"token on average, above learner.max_logprob_gap={max_gap}: the two do not compute the same "
                         "policy (another model or revision, tokenizer or chat template, dtype, logit processing). "
                         "Training on them would weigh every token wrongly; raise learner.max_logprob_gap, or null "
                         "to train anyway")


def optimizer_step(engine, world_size: int) -> tuple[float, bool]:
    """engine.step(), unless the gradient is not finite: then no rank steps, and the gradient is dropped. DeepSpeed's
    ZeRO optimizers check the global norm themselves; without ZeRO we do. Returns the norm of the gradient the step
    applies (the ranks' average) before clipping, and whether the step was taken."""
    if engine.zero_optimization_stage() > 0:
        engine.step()
        return float(engine.get_global_grad_norm()), engine.was_step_applied()
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if world_size > 1:
        # step() averages the ranks' gradients (stage 0 reduces there, not in backward): the norm that is reported,
        # and clipped to, is the average's, which no rank holds before; one reduction of a copy gives it to each
        total = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(total)
        norm = torch.linalg.vector_norm(total) / world_size
    elif grads:
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    else:
        norm = torch.zeros((), device=engine.device)
    finite = torch.isfinite(norm).float()  # the same on every rank: every rank steps, or none
    if finite.item():
        engine.step()
    else:
        engine.zero_grad()
    return norm.item(), bool(finite.item())


def critic_advantages(module: torch.nn.Module, batches: list[dict], alg: AlgorithmConfig,
                      reference: torch.nn.Module | None) -> float:
    """PPO (algorithm/ppo.py): each sample's token rewards, GAE against the value head's estimates, advantages
    whitened over the whole batch; written into the batches as their `advantages` and `returns` (value targets),
    beside their `old_logprobs` (no weight has moved yet). Returns the summed KL to the reference where it is a
    reward penalty (0 otherwise)."""
    kl_sum = 0.0
    with torch.no_grad():
        for batch in batches:
            scores = score(module, batch)
            batch["old_logprobs"] = scores.logprobs
            kl = None
            if reference is not None and alg.kl_penalty == "reward":
                kl = kl_to_reference(scores.logprobs, score(reference, batch).logprobs, alg.kl_estimator)
                kl_sum += kl.sum()  # on the device: read once
            advantages, targets, start = [], [], 0
            for tokens, sample_return in zip(batch["row_tokens"], batch["sample_returns"]):
                end = start + tokens
                rewards = token_rewards(sample_return, tokens, None if kl is None else kl[start:end], alg.kl_coef)
                a, r = gae(rewards, scores.values[start:end], alg.gae_lambda)
                advantages.append(a)
                targets.append(r)
                start = end
            empty = torch.zeros(0, device=scores.values.device)
            batch["advantages"] = torch.cat(advantages) if advantages else empty
            batch["returns"] = torch.cat(targets) if targets else empty
    whitened = whiten(torch.cat([b["advantages"] for b in batches])).split([len(b["advantages"]) for b in batches])
    for batch, a in zip(batches, whitened):
        batch["advantages"] = a
    return float(kl_sum)


def peak_mib(device: torch.device) -> float:
    """This rank's peak memory so far: the GPU's allocated bytes, or on CPUs the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


