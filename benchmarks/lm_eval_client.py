"""lm-eval's API client (`--model local-completions`) against a running policy endpoint, beside transformers scoring
the same checkpoint in this process: not a speed comparison but the check that an evaluation through the endpoint
reads what the model says.

    lightning-ray serve model.path=runs/<run>/checkpoint &           # or the job's endpoint while it trains
    python benchmarks/lm_eval_client.py runs/<run>/checkpoint [--url http://127.0.0.1:8000] [--model policy]

Eight (context, continuation) pairs through lm-eval 0.4.13's loglikelihood (echo with logprobs: the prompt scored),
one question through its generate_until. Prints one JSON line: each pair's loglikelihood and greedy flag both ways,
the largest difference, and the client's seconds. The key, if the endpoint has one: OPENAI_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " a banana"),
         ("2 + 2 =", " 4"), ("2 + 2 =", " 5"), ("Water is made of hydrogen and", " oxygen"),
         ("Question: What is 12 * 3?\nAnswer:", " 36"), ("Question: What is 12 * 3?\nAnswer:", " 38"),
         ("Once upon a time", " there was a little girl who")]


def own_scores(checkpoint: str) -> list[tuple[float, bool]]:
    """Each continuation's log-probability and whether it is the greedy one, as lm-eval splits the tokens."""
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for context, continuation in PAIRS:
        ids, start = tok.encode(context + continuation), len(tok.encode(context))
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, start - 1:-1].float(), -1)
        target = torch.tensor(ids[start:])
        out.append((logprobs.gather(-1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="the served model's directory (its tokenizer is lm-eval's)")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="policy", help="the served model's name (model.name)")
    args = parser.parse_args()
    lm = LocalCompletionsAPI(base_url=f"{args.url}/v1/completions", model=args.model, tokenizer=args.checkpoint,
                             tokenizer_backend="huggingface", num_concurrent=4, batch_size=4, max_retries=1)
    start = time.perf_counter()
    served = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)])
    seconds = time.perf_counter() - start
    [answer] = lm.generate_until([Instance("generate_until", {}, (PAIRS[5][0], {"until": ["\n"], "max_gen_toks": 8}),
                                           0)])
    own = own_scores(args.checkpoint)
    print(json.dumps({
        "benchmark": "lm_eval_client", "checkpoint": args.checkpoint,
        "pairs": [{"context": c, "continuation": x, "served": s, "transformers": o, "served_greedy": sg,
                   "transformers_greedy": og} for (c, x), (s, sg), (o, og) in zip(PAIRS, served, own)],
        "max_abs_diff": max(abs(s - o) for (s, _), (o, _) in zip(served, own)),
        "greedy_agree": all(sg == og for (_, sg), (_, og) in zip(served, own)),
        "loglikelihood_s": round(seconds, 2), "generate_until": answer}), flush=True)


if __name__ == "__main__":
    main()
