"""A mixture-of-experts base through the server: `/v1/models` names its family for the base
model and for an uploaded adapter on its experts, the upload refuses an adapter on MLP
modules the experts replace (400, naming what the base offers), and greedy completions of
the base and the expert adapter equal the offline engine's (float32)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_family, tiny_llm
from live_server import start_server

from punica_x import SamplingParams

PROMPT = [3 + (7 * i) % 250 for i in range(24)]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe-srv")
    folder = make_tiny_family(
        root / "olmoe", "olmoe", num_experts=8, num_experts_per_tok=2, max_position_embeddings=512
    )
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapters = {
        "experts": make_peft_adapter(
            base, root / "experts", 4, ["q_proj"], 1, target_parameters=EXPERTS
        ),
    }
    srv = start_server(folder, root / "data")
    yield srv, folder, adapters
    srv.stop()


def test_models_name_the_family_and_completions_equal_the_engine(moe_server, tiny_adapters):
    srv, folder, adapters = moe_server
    key = srv.create_tenant("moe")
    assert srv.upload(key, "exp", adapters["experts"]).status_code == 201
    refused = srv.upload(key, "dense", tiny_adapters["r16"])
    assert refused.status_code == 400 and "this olmoe base model's modules are" in refused.text
    with srv.http(key) as c:
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert models[srv.model_id]["family"] == models["exp"]["family"] == "olmoe"
    llm = tiny_llm(folder)
    llm.load_adapter("exp", str(adapters["experts"]))
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for model, adapter in ((srv.model_id, None), ("exp", "exp")):
        (want,) = llm.generate([PROMPT], [adapter], sp)
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        with srv.http(key, timeout=120) as c:
            r = c.post("/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
