"""HF transformers + PEFT generating the same batches as punica-x, float32: the backbone
alone, a mixed-adapter batch (adapter_names=), and one adapter at a time (each adapter's
requests batched, adapters in turn)."""

from __future__ import annotations

import time
from pathlib import Path

import torch


class HFBaselines:
    def __init__(self, model_dir: Path, adapter_paths: list[Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:  # batches are padded (left); the pad is never read
            self.tok.pad_token = self.tok.eos_token
        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            adapter_paths[0],
            adapter_name="a0",
        ).eval()
        for i, path in enumerate(adapter_paths[1:], start=1):
            self.peft.load_adapter(path, adapter_name=f"a{i}")

    def _generate(self, model, prompts, n, **kwargs) -> int:
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.tok.pad_token_id or self.tok.eos_token_id,
                **kwargs,
            )
        return (out.shape[1] - enc.input_ids.shape[1]) * len(prompts)

    def backbone(self, prompts, n) -> float:
        t0 = time.perf_counter()
        tokens = self._generate(self.base, prompts, n)
        return tokens / (time.perf_counter() - t0)

    def mixed(self, prompts, names, n) -> float:
        t0 = time.perf_counter()
        tokens = self._generate(self.peft, prompts, n, adapter_names=names)
        return tokens / (time.perf_counter() - t0)

    def one_at_a_time(self, prompts, names, n) -> float:
        t0 = time.perf_counter()
        tokens = 0
        for name in dict.fromkeys(names):
            self.peft.set_adapter(name)
            tokens += self._generate(self.peft, [p for p, a in zip(prompts, names) if a == name], n)
        return tokens / (time.perf_counter() - t0)
