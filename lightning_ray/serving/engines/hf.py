"""HF transformers engine: the small embedded engine, CPU-friendly, one request at a time."""

from __future__ import annotations

import threading

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_ray.serving.engines.base import Generation, SamplingParams


class HFEngine:
    def __init__(self, model_path: str, dtype: str = "float32"):
        transformers.logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        # One generation at a time: the model is shared, and a weight load must not land mid-generation.
        self.lock = threading.Lock()
        self.policy_version = 0

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        sample = params.temperature > 0
        with self.lock:
            if params.seed is not None:
                torch.manual_seed(params.seed)
            version = self.policy_version
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=params.max_tokens,
                do_sample=sample,
                temperature=params.temperature if sample else None,
                top_p=params.top_p if sample else None,
                top_k=None,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,  # raw logits: the logprobs we report are the policy's, not the sampler's
            )
        token_ids = out.sequences[0, len(prompt_ids):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, token_ids)]
        finish = "stop" if token_ids and token_ids[-1] == self.tokenizer.eos_token_id else "length"
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish, policy_version=version)

    def load_weights(self, state_dict: dict, version: int) -> None:
        with self.lock:
            self.model.load_state_dict(state_dict)
            self.policy_version = version
