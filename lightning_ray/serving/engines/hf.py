"""HF transformers engine: the small embedded engine, CPU-friendly, and on a CUDA device where the replica has one.

A plain sampling loop over the KV cache rather than `model.generate`: it streams token by token, reports the
raw (untempered) logprob of every sampled token, and seeds a per-request generator. One request runs at a time
(the model is shared); a weight load lands between two decoding steps, and a generation that goes on across it
(serve.drain=keep) re-reads its context under the new weights: each token is sampled by one version, the one its
delta names. A JSON constraint masks
the logits each step with an xgrammar matcher (grammar.JsonGrammars), which accepts every sampled token.
"""

from __future__ import annotations

import asyncio
import math
import threading
from functools import cached_property
from typing import AsyncIterator

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from lightning_ray.serving.engines.base import SamplingParams, TokenDelta, WeightLoading, check_weights
from lightning_ray.serving.engines.grammar import JsonGrammars, apply_bitmask
from lightning_ray.weight_sync.adapter import Adapter, read_all


class HFEngine(WeightLoading):
    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, gpu_memory_utilization: float = 0.9,
                 adapter: str | None = None, lora_rank: int | None = None):
        """adapter: a directory of LoRA adapters (peft's), served on the model from the start (a resumed LoRA run);
        lora_rank: the rank LoRA runs train (vLLM's setting: the HF engine takes any). Each request is served with
        the adapter it names (SamplingParams.adapter), or by the base; one not loaded yet is the base too (an
        adapter starts as the base: its B is zero)."""
        transformers.logging.disable_progress_bar()
        torch.manual_seed(seed)  # requests without a seed of their own draw from the process's generator
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # The replica's GPU where Ray gave it one (Ray sets CUDA_VISIBLE_DEVICES to it: it is cuda:0 here)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":  # colocated with a learner: leave it the rest of the GPU
            torch.cuda.set_per_process_memory_fraction(gpu_memory_utilization)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").to(self.device).eval()
        # Every end-of-sequence id, as vLLM stops on them: the tokenizer's and the generation config's (one or a
        # list; chat models often end turns on a token of their own). Same stops, same training data per engine.
        configured = self.model.generation_config.eos_token_id
        self.eos_ids = {i for i in [self.tokenizer.eos_token_id, *(configured if isinstance(configured, list)
                                                                    else [configured])] if i is not None}
        self.turn = threading.Lock()  # one generation at a time
        self.lock = threading.Lock()  # the weights: held for one decoding step, or for a load
        self.policy_version = 0
        self._shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        self._staged: dict | tuple[Adapter, ...] | None = None
        self._adapter_shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # learner.lora: each adapter's tensors
        self._active: str | None = None  # the adapter the model runs with (None: the base)
        if adapter:
            self._apply(read_all(adapter))

    @cached_property
    def grammars(self) -> JsonGrammars:
        """Built on the first JSON request: the tokenizer's vocabulary is indexed once, for the model's logits."""
        return JsonGrammars(self.tokenizer, self.model.config.vocab_size)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
        cancelled = threading.Event()

        def produce():
            try:
                for delta in self._sample(prompt_ids, params, cancelled):
                    loop.call_soon_threadsafe(deltas.put_nowait, delta)
            except BaseException as e:  # surfaced to the awaiting request
                loop.call_soon_threadsafe(deltas.put_nowait, e)
            loop.call_soon_threadsafe(deltas.put_nowait, None)

        threading.Thread(target=produce, daemon=True).start()
        try:
            while (delta := await deltas.get()) is not None:
                if isinstance(delta, BaseException):
                    raise delta
                yield delta
        finally:
            cancelled.set()  # a client that hung up stops the generation

    @torch.inference_mode()
    def _sample(self, prompt_ids: list[int], params: SamplingParams, cancelled: threading.Event):
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        rng = torch.Generator(self.device).manual_seed(params.seed) if params.seed is not None else None
        matcher = None
        if params.json_schema is not None:  # compiled (or found in the cache) before taking the model
            matcher, bitmask = self.grammars.matcher(params.json_schema, stop), self.grammars.bitmask()
        with self.turn:
            self._use_adapter(params.adapter)
            context, version = list(prompt_ids), None
            steps = min(params.max_tokens, len(params.forced_token_ids or ()) or params.max_tokens)
            for step in range(steps):
                if cancelled.is_set():
                    return
                with self.lock:
                    if version != self.policy_version:  # the first step, or new weights: the context read under them
                        version, cache = self.policy_version, DynamicCache()
                        inputs = torch.tensor([context], device=self.device)
                    logits = self.model(input_ids=inputs, past_key_values=cache, use_cache=True).logits[0, -1].float()
                if matcher is not None:  # tokens the grammar rules out get -inf: never sampled, probability 0
                    matcher.fill_next_token_bitmask(bitmask)
                    apply_bitmask(logits, bitmask.to(logits.device))  # the mask is filled on the host
                logprobs = torch.log_softmax(logits, -1)
                token = (params.forced_token_ids[step] if params.forced_token_ids else
                         _sample_token(logits, params.temperature, params.top_p, rng))
                top = {}
                if params.top_logprobs:
                    values, ids = logprobs.topk(params.top_logprobs)
                    top = {i: v for i, v in zip(ids.tolist(), values.tolist()) if v > -math.inf}
                # The matcher's stop tokens are ours: once the JSON is complete it allows only them, and accepting
                # one terminates it, so the generation ends as "stop" exactly when the matcher terminates.
                if matcher is not None and not matcher.accept_token(token):
                    raise RuntimeError(f"the JSON grammar rejected token {token}, which its own mask allowed")
                finish = "stop" if token in stop else "length" if step + 1 == steps else None
                yield TokenDelta(token_ids=[token], logprobs=[logprobs[token].item()],
                                 top_logprobs=[top] if params.top_logprobs else [], finish_reason=finish,
                                 policy_version=version)
                if finish:
                    return
                context.append(token)
                inputs = torch.tensor([[token]], device=self.device)

    async def stage_weights(self, weights: dict | tuple[Adapter, ...]) -> None:
        """A whole state dict, or (learner.lora) adapters, each checked against the one served under its name once
        there is one."""
        if isinstance(weights, tuple):
            for adapter in weights:
                if shapes := self._adapter_shapes.get(adapter.name):
                    check_weights(adapter.tensors(), shapes)
        else:
            check_weights(weights, self._shapes)
        self._staged = weights

    async def swap_weights(self, version: int) -> None:
        def swap():
            with self.lock:  # between two decoding steps
                try:  # load_state_dict goes on past a tensor it cannot copy: the rest are new, that one old
                    self._apply(self._staged)
                except Exception as e:
                    self.broken = f"loading policy version {version} failed part way: {e}"
                    raise RuntimeError(self.broken) from e
                self.policy_version, self.broken, self._staged = version, None, None

        await asyncio.to_thread(swap)

    def _apply(self, weights: dict | tuple[Adapter, ...]) -> None:
        if not isinstance(weights, tuple):
            self.model.load_state_dict(weights)
            return
        import peft

        for adapter in weights:  # a new one's layers go on the base, which stays
            if not isinstance(self.model, peft.PeftModel):
                self.model = peft.get_peft_model(self.model, adapter.config(), adapter_name=adapter.name).eval()
                self._active = adapter.name
            elif adapter.name not in self.model.peft_config:
                self.model.add_adapter(adapter.name, adapter.config())
            tensors = adapter.tensors()
            # a tensor whose shape differs raises; one the model has no place for is named
            loaded = peft.set_peft_model_state_dict(self.model, tensors, adapter_name=adapter.name)
            if extra := loaded.unexpected_keys:
                raise ValueError(f"adapter {adapter.name!r} does not fit the served model: {extra[:5]}")
            self._adapter_shapes[adapter.name] = {n: tuple(t.shape) for n, t in tensors.items()}  # later ones: the same

    def _use_adapter(self, name: str | None) -> None:
        """The model runs with this adapter from now on (None, or one not loaded: the base); one generation at a
        time, so it holds for the whole of one."""
        if not self._adapter_shapes:
            return
        name = name if name in self._adapter_shapes else None
        if name != self._active:
            with self.lock:
                if name is None:
                    self.model.base_model.disable_adapter_layers()
                else:
                    self.model.base_model.enable_adapter_layers()
                    self.model.base_model.set_adapter(name)
                self._active = name

    # ---- sleep while a colocated learner trains (engine.sleep_while_training) --------------------------------
    async def sleep(self) -> None:
        """The weights to the host, the GPU's cache emptied: the learner gets the memory (nothing to free on CPUs)."""
        if self.device.type == "cuda":
            def offload():
                with self.lock:
                    self.model.to("cpu")
                    torch.cuda.empty_cache()
            await asyncio.to_thread(offload)

    async def wake_up(self) -> None:
        if self.device.type == "cuda":
            def reload():
                with self.lock:
                    self.model.to(self.device)
            await asyncio.to_thread(reload)

    # ---- weights as tensors on a device (weight_sync's cuda_ipc and collective transports) ------------------
    def check_layout(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Names and shapes of what is about to be copied: the parameters, a tied weight once."""
        check_weights({n: torch.empty(s, device="meta") for n, s in shapes.items()},
                      {n: tuple(p.shape) for n, p in self.model.named_parameters()})

    def weights_device(self) -> torch.device:
        return next(self.model.parameters()).device

    async def copy_weights(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy into the parameters in place (casting to their dtype), between two decoding steps; call with admission
        paused. A tensor that fails part way leaves the weights mixed: `broken`, as swap_weights."""
        parameters = dict(self.model.named_parameters())

        def copy():
            with self.lock, torch.no_grad():
                try:
                    for name, t in tensors:
                        parameters[name].copy_(t, non_blocking=True)
                    if self.weights_device().type == "cuda":
                        torch.cuda.synchronize(self.weights_device())  # done before the sender may reuse its memory
                except Exception as e:
                    self.broken = f"loading policy version {version} failed part way: {e}"
                    raise RuntimeError(self.broken) from e
                self.policy_version, self.broken = version, None

        await asyncio.to_thread(copy)


GREEDY_BELOW = 1e-5  # as vLLM: a smaller temperature would overflow logits / T (found by the fuzz test)


def _sample_token(logits: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator | None) -> int:
    if temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=rng))
