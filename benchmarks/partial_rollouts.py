"""Partial rollouts: what a weight update costs the generations in flight, per `serve.drain`, on the same work —
`wait` (they finish first, then the weights load: sync's default), `abort` (they end at once with a 503 the agent's
openai client retries, generating again from the start), `keep` (they pause, the weights load, they go on under the
new version: async's default). Each mode deploys the main job's endpoint (SmolLM2 on vLLM by default) and runs the
same round `--repeats` times without an update, then as often with one: `--calls` chat calls of `--tokens` tokens each
(ignore_eos) through the real openai client, not streamed, as agents call; the update is a new version published by
a stand-in learner once half the rounds' median time without one has passed. One JSON line per mode (medians; each
round's figures under `runs`), then one with the ratios to `wait`:

- sync_s: publish → every replica serving the new version (what the learner waits for before its next rollouts);
- round_s, round_no_update_s: the round's calls, all answered, with and without the update; round_vs_no_update: the
  first over the second, the same mode's own deployment (each mode's own baseline round, beside the ratios to wait);
- calls_across_updates: calls the update landed in, recorded with the tokens each version produced;
- retried_calls: calls the update ended (abort), which the client sent again (their tokens, never trained, are lost;
  a call that is not streamed has none recorded: vLLM gives its tokens at the end).

    .venv/bin/python benchmarks/partial_rollouts.py --repeats 3            # ~15 min on 2 cores
    python benchmarks/partial_rollouts.py --calls 16 --tokens 448 experiment=calc_tiny placement=colocated \
        engine.sleep_while_training=false                                  # one GPU (make gpu-check's step)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch
from openai import OpenAI
from weight_sync import learner_actor

from lightning_ray.config import compose
from lightning_ray.config.schema import default_drain, installed_vllm
from lightning_ray.models import resolve_model_path
from lightning_ray.tracing import semconv
from lightning_ray.types import Task

MODES = ("wait", "abort", "keep")
PROMPT = [{"role": "user", "content": "Tell me a long story about a calculator that learned to add."}]


class Round:
    """One round of calls, each its own rollout (its spans are the round's record), published into halfway if
    `publish_at` is given."""

    def __init__(self, url: str, cfg, store, calls: int, tokens: int):
        self.client = OpenAI(base_url=f"{url}/v1", api_key=cfg.serve.api_key or "EMPTY", max_retries=5, timeout=600)
        self.model, self.store, self.calls, self.tokens = cfg.model.name, store, calls, tokens

    def run(self, publish_at: float | None = None, publish=None) -> dict:
        rollouts = [r.rollout_id for r in self.store.enqueue([Task(task_id=f"call-{i}", input={})
                                                              for i in range(self.calls)])]
        with ThreadPoolExecutor(self.calls) as pool:
            start = time.perf_counter()
            answers = [pool.submit(self.call, r) for r in rollouts]
            sync_s = None
            if publish_at is not None:
                time.sleep(publish_at)
                sync_s = publish()
            lengths = [a.result() for a in answers]
            seconds = time.perf_counter() - start
        assert lengths == [self.tokens] * self.calls, lengths  # every call answered in full
        return {"seconds": seconds, "sync_s": sync_s, **record(self.store.query_spans(rollouts))}

    def call(self, rollout: str) -> int:
        out = self.client.chat.completions.create(
            model=self.model, messages=PROMPT, max_tokens=self.tokens, temperature=1.0,
            extra_body={"ignore_eos": True}, extra_headers={"X-Rollout-Id": rollout})
        return out.usage.completion_tokens


def record(spans) -> dict:
    """What the round's call spans say: the calls an update landed in, those it ended, tokens per version."""
    calls = [s for s in spans if s.name == semconv.LLM_CALL]
    answered = [s.attributes[semconv.POLICY_VERSION_SPANS] for s in calls if s.status != "error"]
    by_version = Counter()
    for runs in answered:  # [version, begin, end) of the call's tokens
        for version, begin, end in runs:
            by_version[version] += end - begin
    return {"calls_across_updates": sum(len(runs) > 1 for runs in answered),
            "retried_calls": len(calls) - len(answered), "tokens_by_version": dict(sorted(by_version.items()))}


def check_fits(path: str, tokens: int, max_model_len: int) -> None:
    """Before deploying anything: a call past the context would be refused (400) in the untimed first round."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = len(tokenizer.encode(tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False))
    if prompt + tokens > max_model_len:
        raise SystemExit(f"--tokens {tokens} and the prompt's {prompt} tokens pass engine.max_model_len="
                         f"{max_model_len}: at most --tokens {max_model_len - prompt}")


def run_mode(mode: str, overrides: list[str], args) -> dict:
    """One deployment of the endpoint with its own weight registry and stand-in learner (a registry that outlived a
    deleted app would count its replicas as behind until their one-second liveness check)."""
    from lightning_ray import weight_sync
    from lightning_ray.serving.app import APP_NAME, deploy_policy
    from lightning_ray.serving.deploy import delete_apps
    from lightning_ray.store.client import StoreClient
    from lightning_ray.weight_sync.registry import WeightRegistry

    run_dir = Path(tempfile.mkdtemp(prefix=f"partial-rollouts-{mode}-"))
    cfg = compose([*overrides, f"serve.drain={mode}", f"run_dir={run_dir}"])
    path, kind, cuda = str(resolve_model_path(cfg.model)), weight_sync.of_run(cfg), torch.cuda.is_available()
    check_fits(path, args.tokens, cfg.engine.max_model_len)
    # a stand-in for learner rank 0 that publishes as the run's would (its transport, its device; cuda_ipc: the
    # replica's GPU, shared)
    registry, gpus = WeightRegistry.remote(), (0.5 if kind == "cuda_ipc" else 1) if cuda else 0
    learner = learner_actor(registry, path, kind, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32,
                            gpus)
    store = StoreClient.start(run_dir)
    url, version = deploy_policy(cfg, path, store, registry), [0]

    def publish() -> float:
        version[0] += 1
        start = time.perf_counter()
        ray.get(learner.publish.remote(version[0]))
        ray.get(registry.wait_synced.remote(version[0], 600))
        return time.perf_counter() - start

    try:
        Round(url, cfg, store, 2, args.tokens).run()  # the engine's first calls: not timed
        rounds = Round(url, cfg, store, args.calls, args.tokens)
        reference = [rounds.run()["seconds"] for _ in range(args.repeats)]
        updated = [rounds.run(statistics.median(reference) / 2, publish) for _ in range(args.repeats)]
        mid = sorted(updated, key=lambda u: u["seconds"])[len(updated) // 2]
        return {"benchmark": "partial_rollouts", "drain": mode, "model": cfg.model.path or "tiny",
                "engine": cfg.engine.kind, "calls": args.calls, "tokens": args.tokens, "repeats": args.repeats,
                "publish_at_s": round(statistics.median(reference) / 2, 2),
                "sync_s": round(statistics.median(u["sync_s"] for u in updated), 3),
                "round_s": round(mid["seconds"], 2), "round_no_update_s": round(statistics.median(reference), 2),
                # what the update cost this mode's round, against its own round without one (the same deployment)
                "round_vs_no_update": round(mid["seconds"] / statistics.median(reference), 3),
                **{k: mid[k] for k in ("calls_across_updates", "retried_calls", "tokens_by_version")},
                "runs": {"sync_s": [round(u["sync_s"], 3) for u in updated],
                         "round_s": [round(u["seconds"], 2) for u in updated],
                         "round_no_update_s": [round(r, 2) for r in reference]}}
    finally:
        delete_apps([APP_NAME])
        store.close()
        ray.kill(learner)
        ray.kill(registry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of each kind per mode (the median is kept)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default: experiment=calc_smollm2)")
    args = parser.parse_args()
    overrides = args.overrides or ["experiment=calc_smollm2"]
    ray.init(include_dashboard=False, log_to_driver=False)
    results = []
    cfg = compose(overrides)
    for mode in args.modes:
        if mode == "keep" and default_drain("async", cfg.engine.kind, installed_vllm()) != "keep":
            print(json.dumps({"benchmark": "partial_rollouts", "drain": mode, "skipped": "this vLLM does not label "
                              "each token with its weights' version (0.25): it cannot keep"}), flush=True)
            continue
        results.append(run_mode(mode, overrides, args))
        print(json.dumps(results[-1]), flush=True)
    wait = next((r for r in results if r["drain"] == "wait"), None)
    for r in results:
        if wait and r is not wait:
            print(json.dumps({"benchmark": "partial_rollouts", "compare": f"{r['drain']} / wait",
                              "sync_s": round(r["sync_s"] / wait["sync_s"], 3),
                              "round_s": round(r["round_s"] / wait["round_s"], 3),
                              # each mode's round over its own no-update round (a fresh deployment each)
                              "round_vs_no_update": {m["drain"]: m["round_vs_no_update"] for m in (r, wait)}}),
                  flush=True)


if __name__ == "__main__":
    main()
