"""scripts/gguf_standin.py: the default model's first layers as a GGUF file a lent GPU machine
is carried (tests/punica_x/test_engine_cuda.py serves it there): its tensors byte for byte,
the layer count its own, and the engine serves it as it serves the file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from punica_x import LLM, SamplingParams
from punica_x.models import gguf_header
from punica_x.models.loader import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "gguf_standin", ROOT / "scripts" / "gguf_standin.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gguf_standin"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_standin_is_the_files_first_layers(tmp_path):
    import gguf

    out = tmp_path / "standin.gguf"
    size = _module().write_standin(Path(default_model_path()), out, 2)
    assert size < 40e6  # with the wheels and the tree, under the 64 MiB a device call carries
    source, standin = gguf.GGUFReader(default_model_path()), gguf.GGUFReader(out)
    assert standin.fields["llama.block_count"].contents() == 2
    for key in ("tokenizer.ggml.tokens", "tokenizer.chat_template", "llama.embedding_length"):
        assert standin.fields[key].contents() == source.fields[key].contents()
    by_name = {t.name: t for t in source.tensors}
    names = [t.name for t in standin.tensors]
    assert "token_embd.weight" in names and "blk.1.attn_q.weight" in names
    assert not any(n.startswith("blk.2.") for n in names)
    for t in standin.tensors:
        assert t.tensor_type == by_name[t.name].tensor_type
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(by_name[t.name].data))
    assert len(gguf_header.read_header(out).tensors) == len(names)
    llm = LLM(model=str(out), dtype="float32")
    assert len(llm.engine.model.layers) == 2
    assert llm.engine.model.weight_formats() == "Q4_1,Q8_0"
    out = llm.generate(["hello"], sampling=SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4


def test_layers_out_of_range_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--layers must be 1..30"):
        _module().write_standin(Path(default_model_path()), tmp_path / "x.gguf", 31)
