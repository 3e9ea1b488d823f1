"""lm-evaluation-harness against a live server: its `local-completions` model (the harness's
documented way to evaluate an OpenAI-compatible server) runs a local multiple-choice task on
an uploaded adapter, and every loglikelihood equals the harness's own HF + PEFT model's."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")

QUESTIONS = [
    ("The sky on a clear day is", [" blue", " green", " loud"], 0),
    ("Two plus two equals", [" four", " seven", " a cat"], 0),
    ("A multi tenant server batches", [" adapters", " rivers", " spoons"], 0),
    ("The opposite of hot is", [" cold", " heavy", " early"], 0),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-task")
    data = root / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    (root / "px_tiny_mc.yaml").write_text(
        f"""task: px_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    return root


def loglikelihoods(model: str, model_args: str, task_dir) -> list[float]:
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["px_tiny_mc"],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=1,
        log_samples=True,
        random_seed=0,
    )
    samples = sorted(out["samples"]["px_tiny_mc"], key=lambda s: s["doc_id"])
    return [resp[0][0] for s in samples for resp in s["resps"]]


def test_local_completions_loglikelihoods_equal_hf_peft(
    server, adapter_dirs, srv_model_dir, task_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    key = server.create_tenant("evaluator")
    assert server.upload(key, "eval-a", adapter_dirs["a"]).status_code == 201
    monkeypatch.setenv("OPENAI_API_KEY", key)
    served = loglikelihoods(
        "local-completions",
        f"model=eval-a,base_url={server.url}/v1/completions,tokenizer={srv_model_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
        task_dir,
    )
    reference = loglikelihoods(
        "hf",
        f"pretrained={srv_model_dir},peft={adapter_dirs['a']},dtype=float32,device=cpu",
        task_dir,
    )
    assert len(served) == len(reference) == sum(len(c) for _, c, _ in QUESTIONS)
    assert served == pytest.approx(reference, abs=1e-3)
    assert len(set(round(v, 3) for v in served)) > 1  # the task really scores something
