"""HF transformers engine: the small embedded engine, CPU-friendly, and on a CUDA device where the replica has one.

A plain sampling loop over the KV cache rather than `model.generate`: it streams token by token, reports every
sampled token's logprob under the distribution it was drawn from (the call's temperature and top_p, as vLLM's
`processed_logprobs`), and seeds a per-request generator. The requests in flight decode together, one batch
(continuous batching): each step runs every request's next token through the model at once, a request that arrives
joins at the next step (its prompt run on its own, its KV cache then laid beside the others', left-padded), and one
that ends leaves. So agents calling at once share each step, where one request at a time made
their calls wait in turn. A weight load lands between two steps, and the generations that go on across it
(serve.drain=keep) re-read their contexts under the new weights: each token is sampled by one version, the one its
delta names. With LoRA adapters each request in a batch runs with its own (peft's mixed-adapter batches). A JSON
constraint masks the logits each step with an xgrammar matcher (grammar.JsonGrammars), which accepts every sampled
token. Forced tokens (a teacher's answer, a prompt scored) are scored in one forward pass, outside the batch.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import AsyncIterator, Callable

import ray
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from lightning_ray.serving.engines.base import (SamplingParams, TokenDelta, WeightLoading, check_weights, end_ids,
                                                forced_generation)
from lightning_ray.serving.engines.grammar import JsonGrammars, apply_bitmask
from lightning_ray.serving.engines.sampling import sample
from lightning_ray.weight_sync.adapter import Adapter, read_all

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    """One generation in the batch: its context (the prompt and the tokens sampled so far, the last of them not yet
    in the KV cache), its sampling state, and where its deltas go."""
    context: list[int]
    params: SamplingParams
    stop: set[int]
    emit: Callable[[TokenDelta | BaseException | None], None]  # None: the end
    cancelled: threading.Event
    rng: torch.Generator | None = None
    matcher: object = None
    bitmask: torch.Tensor | None = None
    step: int = 0
    ended: bool = False

    def end(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.emit(error)
        self.emit(None)
        self.ended = True


@dataclass(eq=False)
class _Batch:
    """The requests decoding together and their KV cache, left-padded: `mask` is 0 over each row's padding."""
    requests: list[_Request] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # [rows, cached tokens]
    version: int | None = None  # the weights the cache was computed under


def _device() -> torch.device:
    """The replica's GPU where Ray gave it one (Ray sets CUDA_VISIBLE_DEVICES to it: it is cuda:0 here). Given one
    that torch cannot use, it refuses: serving on the CPUs instead is 10-100x slower, and silent."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if ray.is_initialized() and (gpus := ray.get_gpu_ids()):
        raise RuntimeError(f"this replica was given GPUs {gpus} (serve.resources.GPU), but torch {torch.__version__} "
                           f"cannot use CUDA (torch.version.cuda={torch.version.cuda}; None: a CPU-only build): "
                           "install a CUDA build of torch that the node's driver supports, or serve on CPUs")
    return torch.device("cpu")


def _is_device_error(e: BaseException) -> bool:
    """A CUDA error: the context is usually lost with it (an illegal address, a device-side assert), and every
    later step would fail the same way."""
    return isinstance(e, torch.AcceleratorError) or isinstance(e, RuntimeError) and "CUDA error" in str(e)


class HFEngine(WeightLoading):
    def __init__(self, model_path: str, dtype: str = "float32", seed: int | None = 0,
                 gpu_memory_utilization: float | None = 0.9,
                 adapter: str | None = None, lora_rank: int | None = None, max_num_seqs: int = 64):
        """adapter: a directory of LoRA adapters (peft's), served on the model from the start (a resumed LoRA run);
        lora_rank: the rank LoRA runs train (vLLM's setting: the HF engine takes any). Each request is served with
        the adapter it names (SamplingParams.adapter), or by the base; one not loaded yet is the base too (an
        adapter starts as the base: its B is zero). max_num_seqs: requests decoding at once (the rest wait), halved
        each time the device runs out of memory, doubled back towards it after `regrow_after` steps that fit.
        seed, gpu_memory_utilization: None leaves the process's random generator and memory cap as they are (a
        teacher's engine beside the policy's in its replica: serving/teacher.py)."""
        transformers.logging.disable_progress_bar()
        if seed is not None:  # requests without a seed of their own draw from the process's generator
            torch.manual_seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.device = _device()
        if self.device.type == "cuda" and gpu_memory_utilization is not None:  # colocated: the rest is the learner's
            torch.cuda.set_per_process_memory_fraction(gpu_memory_utilization)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").to(self.device).eval()
        # the stops vLLM's are: same stops, same training data per engine
        self.eos_ids = end_ids(self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id)
        self.lock = threading.Lock()  # the weights: held for one decoding step, or for a load
        self.asleep, self._host = False, {}  # sleep's pinned host copies of the weights, made once
        self.policy_version = 0
        self._shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._staged: dict | tuple[Adapter, ...] | None = None
        self._adapter_shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # learner.lora: each adapter's tensors
        if adapter:
            self._apply(read_all(adapter))
        self.max_num_seqs = self.configured_max_num_seqs = max_num_seqs
        self._fitted = 0  # steps run since max_num_seqs last changed
        self._waiting: list[_Request] = []  # arrived, not yet in the batch (in order)
        self._arrived = threading.Condition()
        threading.Thread(target=self._decode, name="hf-engine-decode", daemon=True).start()

    @cached_property
    def grammars(self) -> JsonGrammars:
        """Built on the first JSON request: the tokenizer's vocabulary is indexed once, for the model's logits."""
        return JsonGrammars(self.tokenizer, self.model.config.vocab_size)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
        cancelled = threading.Event()
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)

        def emit(item):
            if not cancelled.is_set():
                try:
                    loop.call_soon_threadsafe(deltas.put_nowait, item)
                except RuntimeError:  # its event loop is closed: nobody is waiting any more
                    cancelled.set()

        request = _Request(
            context=list(prompt_ids), params=params, stop=stop, emit=emit, cancelled=cancelled,
            rng=torch.Generator(self.device).manual_seed(params.seed) if params.seed is not None else None)
        if params.json_schema is not None:  # compiled (or found in the cache) off the decoding thread
            request.matcher = await asyncio.to_thread(self.grammars.matcher, params.json_schema, stop)
            request.bitmask = self.grammars.bitmask()
        with self._arrived:
            self._waiting.append(request)
            self._arrived.notify()
        try:
            while (delta := await deltas.get()) is not None:
                if isinstance(delta, BaseException):
                    raise delta
                yield delta
        finally:
            cancelled.set()  # a client that hung up stops the generation

    # ---- the decoding thread: one batch, a step at a time ----------------------------------------------------
    def _decode(self) -> None:
        batch = _Batch()
        while True:
            with self._arrived:
                while not self._waiting and not batch.requests:
                    self._arrived.wait()
                joining = self._admit(batch)
            everyone = batch.requests + joining
            try:
                self._step(batch, joining)
            except torch.OutOfMemoryError as e:
                batch = _Batch()  # its KV cache freed
                self._back_off(everyone, e)
            except BaseException as e:  # the model failed: every request in the step gets the error, and the thread
                # goes on for the next ones (a dead one would leave every later request waiting)
                if _is_device_error(e):  # the replica is replaced (its health check fails)
                    self.broken = f"the device failed: {e}"
                for r in everyone:
                    if not r.ended:
                        r.end(e)
                batch = _Batch()
            else:
                self._regrow()

    def _back_off(self, requests: list[_Request], error: torch.OutOfMemoryError) -> None:
        """The device ran out of memory in a step: half as many requests decode at once from now on, and the step's
        go back to the front of the queue, to read their contexts anew (no token lost or sampled twice). A lone
        request that does not fit gets the error."""
        error.with_traceback(None)  # its frames hold the step's tensors: let them go
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        going = [r for r in requests if not r.ended]
        if len(going) <= 1:
            for r in going:
                r.end(error)
            return
        self.max_num_seqs, self._fitted = len(going) // 2, 0
        log.warning("the HF engine ran out of memory decoding %d requests at once: max_num_seqs is now %d",
                    len(going), self.max_num_seqs)
        with self._arrived:
            self._waiting[:0] = going

    regrow_after = 256  # steps

    def _regrow(self) -> None:
        """max_num_seqs doubles back towards the configured one after `regrow_after` steps that fit: what a step
        needs changes (long contexts end; a colocated learner frees what it held), so one step out of memory does
        not cap the replica for good. Should the larger batch not fit, the next back-off halves it again (its cost:
        one step's requests read their contexts anew, once per `regrow_after` steps at most)."""
        if self.max_num_seqs >= self.configured_max_num_seqs:
            return
        self._fitted += 1
        if self._fitted >= self.regrow_after:
            self.max_num_seqs, self._fitted = min(2 * self.max_num_seqs, self.configured_max_num_seqs), 0
            log.info("the HF engine tries %d requests at once again", self.max_num_seqs)

    def _admit(self, batch: _Batch) -> list[_Request]:
        """The waiting requests that join the batch at this step, in order, up to max_num_seqs in all."""
        self._waiting = [r for r in self._waiting if not r.cancelled.is_set()]
        room = self.max_num_seqs - len(batch.requests)
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        return joining

    def _adapters(self, requests: list[_Request]) -> dict:
        """peft's adapter per row, once the model has adapters: each request's, or the base for one naming none or
        one not loaded yet (an adapter starts as the base); read at each step, so a request goes on under an adapter
        loaded with new weights."""
        if not self._adapter_shapes:
            return {}
        return {"adapter_names": [r.params.adapter if r.params.adapter in self._adapter_shapes else "__base__"
                                  for r in requests]}

    def _logits_kept(self, positions: int) -> dict:
        """The logits of a forward pass's last `positions` only: the others (prompt length x vocabulary each, 10 GB in
        bf16 for 32 prompts of 1,024 tokens over Qwen2.5's vocabulary) are never read. Models without the option: all.
        """
        return {"logits_to_keep": positions} if self._keeps_logits else {}

    @torch.inference_mode()
    def _step(self, batch: _Batch, joining: list[_Request]) -> None:
        """One token for every request in the batch, and the first for those joining it; a request whose tokens are
        all given (forced) is scored whole instead, never joining the batch."""
        for r in joining:
            if r.params.forced_token_ids:
                self._score(r)
        joining = [r for r in joining if not r.params.forced_token_ids]
        gone = [i for i, r in enumerate(batch.requests) if r.cancelled.is_set()]
        if gone:
            self._drop(batch, gone)
            if self.asleep and not batch.requests:  # a drain's cancelled calls, dropped after sleep emptied the cache
                torch.cuda.empty_cache()
        if not batch.requests and not joining:
            return
        with self.lock:
            if batch.requests and batch.version != self.policy_version:  # new weights: every context read anew
                joining, batch.requests, batch.cache, batch.mask = batch.requests + joining, [], None, None
            logits = []
            if batch.requests:  # each request's last token, not yet in the cache
                batch.mask = F.pad(batch.mask, (0, 1), value=1)
                tokens = torch.tensor([[r.context[-1]] for r in batch.requests], device=self.device)
                out = self.model(input_ids=tokens, attention_mask=batch.mask, past_key_values=batch.cache,
                                 position_ids=batch.mask.sum(-1, keepdim=True) - 1, use_cache=True,
                                 **self._adapters(batch.requests))
                logits.append(out.logits[:, -1])
            if joining:
                cache, mask, first = self._prefill(joining)
                logits.append(first)
                self._join(batch, cache, mask)
                batch.requests += joining
            batch.version = self.policy_version
        finished = self._sample(batch.requests, torch.cat(logits).float(), batch.version)
        if finished:
            self._drop(batch, finished)

    def _prefill(self, requests: list[_Request]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """The requests' contexts through the model together, left-padded: their KV cache, its mask and each one's
        next-token logits."""
        contexts = [r.context for r in requests]
        width = max(map(len, contexts))
        ids = torch.tensor([[0] * (width - len(c)) + c for c in contexts], device=self.device)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=self.device)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **self._logits_kept(1),
                         **self._adapters(requests))
        return cache, mask, out.logits[:, -1]

    score_rows = 512  # positions per float32 log-softmax when scoring (312 MB over Qwen2.5's vocabulary)

    def _score(self, r: _Request) -> None:
        """Forced decoding in one forward pass over the prompt and the forced tokens, as vLLM's prompt logprobs do it:
        each token's logprob from the logits before it, the tokens cut as a generation would end (at the first stop
        token, or at max_tokens), one delta. A teacher's answer is scored so, and a prompt (echo with logprobs)."""
        forced = forced_generation(r.params, r.stop)
        ids = torch.tensor([r.context + forced[:-1]], device=self.device)
        with self.lock:
            logits = self.model(input_ids=ids, **self._logits_kept(len(forced)), **self._adapters([r])).logits
            version = self.policy_version
        logits, targets, k = logits[0, -len(forced):], torch.tensor(forced, device=logits.device), r.params.top_logprobs
        token_logprobs, tops = [], []
        for i in range(0, len(forced), self.score_rows):  # float32 log-softmax a slice at a time: long prompts fit
            logprobs = torch.log_softmax(logits[i:i + self.score_rows].float(), -1)
            token_logprobs += logprobs.gather(-1, targets[i:i + self.score_rows, None])[:, 0].tolist()
            if k:
                tops += [dict(zip(top_ids, lps)) for lps, top_ids in zip(*(t.tolist() for t in logprobs.topk(k)))]
        r.emit(TokenDelta(token_ids=forced, logprobs=token_logprobs, top_logprobs=tops,
                          finish_reason="stop" if forced[-1] in r.stop else "length", policy_version=version))
        r.end()

    @staticmethod
    def _join(batch: _Batch, cache: DynamicCache, mask: torch.Tensor) -> None:
        """The joining rows' cache beside the batch's, both left-padded to the longer."""
        if batch.cache is None:
            batch.cache, batch.mask = cache, mask
            return
        width = max(batch.mask.shape[1], mask.shape[1])
        pad = (lambda t, dim: F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (width - t.shape[dim], 0)))
        for mine, theirs in zip(batch.cache.layers, cache.layers):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)])
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)])
        batch.mask = torch.cat([pad(batch.mask, 1), pad(mask, 1)])

    @staticmethod
    def _drop(batch: _Batch, rows: list[int]) -> None:
        """Rows out of the batch, and the padding no row needs any more."""
        keep = sorted(set(range(len(batch.requests))) - set(rows))
        batch.requests = [batch.requests[i] for i in keep]
        if not keep:
            batch.cache = batch.mask = None
            return
        index = torch.tensor(keep, device=batch.mask.device)
        batch.cache.batch_select_indices(index)
        batch.mask = batch.mask[index]
        if unused := int(batch.mask.argmax(-1).min()):  # left columns that are padding in every row
            batch.mask = batch.mask[:, unused:]
            for layer in batch.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]

    def _sample(self, requests: list[_Request], logits: torch.Tensor, version: int) -> list[int]:
        """Each request's next token from its row of logits, sent as a delta; the rows whose generation ended. The
        batch is sampled at once and read back in one go: a round trip per row would stall a GPU at every row."""
        failed = {}
        for i, r in enumerate(requests):  # tokens the grammar rules out get -inf: never sampled, probability 0
            if r.matcher is not None:
                try:
                    r.matcher.fill_next_token_bitmask(r.bitmask)
                    apply_bitmask(logits[i], r.bitmask.to(logits.device))  # the mask is filled on the host
                except Exception as e:  # this request's alone
                    failed[i] = e
        tokens, logprobs = sample(logits, [r.params.temperature for r in requests], [r.params.top_p for r in requests],
                                  [r.rng for r in requests])
        token_logprobs = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
        tokens = tokens.tolist()
        top_values, top_ids = logprobs.topk(max(r.params.top_logprobs or 0 for r in requests))
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        finished = []
        for i, r in enumerate(requests):
            token, p = tokens[i], r.params
            # The matcher's stop tokens are ours: once the JSON is complete it allows only them, and accepting one
            # terminates it, so the generation ends as "stop" exactly when the matcher terminates.
            if i not in failed and r.matcher is not None:
                try:
                    if not r.matcher.accept_token(token):
                        raise RuntimeError(f"the JSON grammar rejected token {token}, which its own mask allowed")
                except Exception as e:  # this request's alone
                    failed[i] = e
            if i in failed:
                r.end(failed[i])
                finished.append(i)
                continue
            top = {t: v for t, v in zip(top_ids[i][:p.top_logprobs], top_values[i][:p.top_logprobs]) if v > -math.inf}
            r.step += 1
            finish = "stop" if token in r.stop else "length" if r.step == r.params.max_tokens else None
            r.emit(TokenDelta(token_ids=[token], logprobs=[token_logprobs[i]], top_logprobs=[top] if p.top_logprobs
                              else [], finish_reason=finish, policy_version=version))
            if finish:
                r.end()
                finished.append(i)
            else:
                r.context.append(token)
        return finished

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
            elif adapter.name not in self.model.peft_config:
                self.model.add_adapter(adapter.name, adapter.config())
            tensors = adapter.tensors()
            # a tensor whose shape differs raises; one the model has no place for is named
            loaded = peft.set_peft_model_state_dict(self.model, tensors, adapter_name=adapter.name)
            if extra := loaded.unexpected_keys:
                raise ValueError(f"adapter {adapter.name!r} does not fit the served model: {extra[:5]}")
            self._adapter_shapes[adapter.name] = {n: tuple(t.shape) for n, t in tensors.items()}  # later ones: the same

    # ---- sleep while a colocated learner trains (engine.sleep_while_training) --------------------------------
    async def sleep(self) -> None:
        """The weights to the host, the GPU's cache emptied: the learner gets the memory (nothing to free on CPUs).
        Into pinned host buffers made once: a 1.5B model's copy to pageable memory took 2.6 s on an H100, 0.07 s to
        pinned (../shared/gpu-node), at every iteration of placement=colocated."""
        if self.device.type == "cuda":
            def offload():
                with self.lock, torch.no_grad():
                    tensors = self._tensors()
                    # names gone (peft renames every weight when the first adapter wraps the model): not kept
                    self._host = {n: h for n, h in self._host.items() if n in tensors}
                    for name, t in tensors.items():
                        host = self._host.get(name)
                        if host is None or host.shape != t.shape or host.dtype != t.dtype:
                            host = self._host[name] = torch.empty_like(t, device="cpu", pin_memory=True)
                        host.copy_(t.data, non_blocking=True)
                    torch.cuda.synchronize(self.device)
                    for name, t in tensors.items():
                        t.data = self._host[name]
                    self.asleep = True
                    torch.cuda.empty_cache()
            await asyncio.to_thread(offload)

    async def wake_up(self) -> None:
        if self.device.type == "cuda" and self.asleep:
            def reload():
                with self.lock, torch.no_grad():
                    tensors = self._tensors()
                    try:
                        for t in tensors.values():
                            t.data = t.data.to(self.device, non_blocking=True)
                        torch.cuda.synchronize(self.device)
                    except Exception as e:  # e.g. out of memory part way: back to the host, not half on each
                        for name, t in tensors.items():
                            t.data = self._host[name]
                        torch.cuda.empty_cache()
                        self.broken = f"waking the engine failed (its weights stay on the host): {e}"
                        raise RuntimeError(self.broken) from e
                    self.asleep = False
            await asyncio.to_thread(reload)

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers, a tied weight once (one Parameter, moved once)."""
        return dict(self.model.named_parameters()) | dict(self.model.named_buffers())

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

