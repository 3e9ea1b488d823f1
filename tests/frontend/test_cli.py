"""`punica-x serve` arguments that reach the runners' EngineConfig, without a server."""

from __future__ import annotations

import pytest

from frontend.cli import build_parser, engine_config


def _engine(*args):
    return engine_config(build_parser().parse_args(["serve", *args]))


def test_serve_dtype_reaches_the_model_config():
    assert _engine().model.dtype == "auto"
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        engine = _engine("--dtype", dtype, "--kv-cache-bytes", "1048576")
        assert engine.model.dtype == dtype
        assert engine.cache.kv_cache_bytes == 1048576  # the other flags still arrive


def test_serve_lora_dtype_reaches_the_lora_config():
    assert _engine().lora.lora_dtype == "auto"
    assert _engine("--lora-dtype", "bfloat16").lora.lora_dtype == "bfloat16"
    for bad in ("int4", "bf16", ""):
        with pytest.raises(SystemExit):
            _engine("--lora-dtype", bad)


def test_serve_max_loras_reach_the_lora_config(capsys):
    from frontend.cli import main

    assert (_engine().lora.max_loras, _engine().lora.max_cpu_loras) == (None, None)
    lora = _engine("--max-loras", "8", "--max-cpu-loras", "32").lora
    assert (lora.max_loras, lora.max_cpu_loras) == (8, 32)
    for flag in ("--max-loras", "--max-cpu-loras"):
        for bad in ("0", "-2", "100001"):
            assert main(["serve", flag, bad]) == 2
            assert flag.lstrip("-").replace("-", "_") in capsys.readouterr().err
        with pytest.raises(SystemExit):
            _engine(flag, "eight")


def _check_choices(capsys, flag: str, field: str, good: tuple, bad: tuple) -> None:
    """Each good value of `flag` reaches ModelConfig.<field>; each bad one exits 2 naming it."""
    for value in good:
        assert getattr(_engine(flag, value).model, field) == value
    for value in bad:
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["serve", flag, value])
        assert exit_.value.code == 2
        assert f"invalid choice: '{value}'" in capsys.readouterr().err


def test_serve_quantization_defaults_to_the_files_own_blocks(capsys):
    assert _engine().model.quantization == "auto"
    good, bad = ("auto", "none", "int8", "int4"), ("", "q4", "AUTO", "nan")
    _check_choices(capsys, "--quantization", "quantization", good, bad)


def test_prepare_readies_what_serve_reads(tmp_path, monkeypatch, capsys):
    """prepare --quantization X makes the directory a runner with X reads (auto: the GGUF
    file's metadata directory; none: its dequantized copy), without building kernels."""
    from punica_x import prepare
    from punica_x.models import loader

    asked = []
    monkeypatch.setattr(loader, "resolve_model_dir", lambda m, q: asked.append(q) or tmp_path)
    monkeypatch.setattr(prepare, "build_kernels", lambda jobs, workers: None)
    assert prepare.main(["--no-model"]) == 0 and asked == []
    for flag, want in (((), "auto"), (("--quantization", "none"), "none")):
        assert prepare.main([*flag]) == 0
        assert asked[-1] == want
        assert f"prepare: model ({want}) ready at {tmp_path}" in capsys.readouterr().out


def test_serve_refuses_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--dtype", "int8"])
    assert exit_.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_serve_turns_prefix_caching_off():
    assert _engine().cache.prefix_caching is True
    assert _engine("--no-prefix-caching").cache.prefix_caching is False


def test_serve_memory_planning_flags():
    plain = _engine()
    assert plain.memory.utilization is None and plain.model.max_model_len is None
    engine = _engine("--memory-utilization", "0.5", "--kv-fraction", "0.6", "--max-model-len", "96")
    assert (engine.memory.utilization, engine.memory.kv_fraction) == (0.5, 0.6)
    assert engine.model.max_model_len == 96


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--memory-utilization", "0"),
        ("--memory-utilization", "1.5"),
        ("--memory-utilization", "nan"),
        ("--memory-utilization", "-inf"),
        ("--kv-fraction", "1"),
        ("--kv-fraction", "0"),
        ("--kv-fraction", "nan"),
        ("--max-model-len", "0"),
        ("--max-model-len", "-5"),
        ("--simulated-step-ms", "0"),
        ("--simulated-step-ms", "-1"),
        ("--simulated-step-ms", "nan"),
        ("--simulated-step-ms", "inf"),
        ("--simulated-step-ms", "1e9"),
        ("--stream-interval", "0"),
        ("--stream-interval", "-3"),
        ("--stream-interval", "4097"),
    ],
)
def test_serve_refuses_bad_memory_flags(flag, value, capsys):
    from frontend.cli import main

    assert main(["serve", f"{flag}={value}"]) == 2
    assert flag.lstrip("-").replace("-", "_").removeprefix("memory_") in capsys.readouterr().err


def test_serve_quant_activations_reach_the_model_config(capsys):
    assert _engine().model.quant_activations == "int16"
    good, bad = ("int16", "int8", "float"), ("int4", "INT8", "", "fp32")
    _check_choices(capsys, "--quant-activations", "quant_activations", good, bad)


def test_serve_batch_invariant_reaches_the_model_config(capsys):
    assert _engine().model.batch_invariant == "auto"
    _check_choices(
        capsys, "--batch-invariant", "batch_invariant", ("auto", "on", "off"), ("ON", "1", "")
    )


def test_serve_simulated_step_reaches_the_model_config():
    assert _engine().model.simulated_step_ms is None
    assert _engine("--simulated-step-ms", "2.5").model.simulated_step_ms == 2.5


def test_serve_overlap_reaches_the_engine_config(capsys):
    assert _engine().overlap == "auto"
    for mode in ("auto", "on", "off"):
        assert _engine("--overlap", mode).overlap == mode
    for bad in ("yes", "ON", ""):
        with pytest.raises(SystemExit) as exit_:
            _engine("--overlap", bad)
        assert exit_.value.code == 2
        assert "--overlap" in capsys.readouterr().err


def test_serve_stream_interval_reaches_the_engine_config(capsys):
    assert _engine().stream_interval == 1
    assert _engine("--stream-interval", "8").stream_interval == 8
    for bad in ("x", "2.5", ""):
        with pytest.raises(SystemExit) as exit_:
            _engine("--stream-interval", bad)
        assert exit_.value.code == 2
        assert "--stream-interval" in capsys.readouterr().err


def test_prepare_remeasures_the_batch_invariant_decision(tmp_path, monkeypatch, capsys):
    """--remeasure-invariance forgets the kept decisions, then loads the model so that its
    decision is measured now (models/invariant_choice.py)."""
    from types import SimpleNamespace

    from punica_x import prepare
    from punica_x.models import invariant_choice, loader

    done = []
    monkeypatch.setattr(loader, "resolve_model_dir", lambda m, q: tmp_path)
    monkeypatch.setattr(prepare, "build_kernels", lambda jobs, workers: None)
    monkeypatch.setattr(
        invariant_choice, "forget_decisions", lambda: done.append("forget") or ["k"]
    )

    def load_model(cfg):
        done.append(("load", cfg.batch_invariant))
        return SimpleNamespace(invariance=SimpleNamespace(reason="auto: on, measured now"))

    monkeypatch.setattr(loader, "load_model", load_model)
    assert prepare.main([]) == 0 and done == []
    assert prepare.main(["--remeasure-invariance"]) == 0
    assert done == ["forget", ("load", "auto")]
    out = capsys.readouterr().out
    assert "1 kept decisions forgotten" in out and "auto: on, measured now" in out


@pytest.mark.parametrize("bad", ["-1", "soon", "nan", "1e9"])
def test_serve_refuses_a_bad_quiet_wait_at_start(bad, monkeypatch, capsys):
    """$PUNICA_X_QUIET_WAIT (how long a first start waits to time the batch-invariant mode)
    is refused before anything starts: exit 2 naming it."""
    from frontend.cli import main

    monkeypatch.setenv("PUNICA_X_QUIET_WAIT", bad)
    assert main(["serve", "--data-dir", "unused"]) == 2
    assert "PUNICA_X_QUIET_WAIT" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "distkv"),
    [
        ([], True),
        (["--no-distkv"], False),
        (["--policy", "mlfq"], False),
        (["--policy", "mlfq", "--runner-backend", "ray"], False),
        (["--attention-workers", "3"], False),
    ],
)
def test_serve_runs_distkv_only_where_it_can(flags, distkv, caplog):
    """DistKV is on by default, off with --no-distkv, and off (logged) beside the mlfq policy
    or attention workers: a Ray runner under mlfq failed its kv_enable at start (exit 1)."""
    from frontend.cli import server_config

    args = build_parser().parse_args(["serve", *flags])
    with caplog.at_level("INFO", logger="punica_x.server"):
        assert server_config(args, None).distkv is distkv
    logged = "DistKV is off" in caplog.text
    assert logged is (not distkv and "--no-distkv" not in flags)


def test_a_server_config_with_distkv_beside_mlfq_is_refused():
    from dataclasses import replace

    from frontend.config import ServerConfig
    from punica_x.config import BatchConfig, EngineConfig

    engine = replace(EngineConfig(), batch=BatchConfig(policy="mlfq"))
    with pytest.raises(ValueError, match="mlfq policy's KV swapping"):
        ServerConfig(engine=engine)
    assert ServerConfig(engine=engine, distkv=False).distkv is False


def test_serve_refuses_a_lora_source_root_that_is_not_a_folder(tmp_path, capsys):
    from frontend.cli import main

    (tmp_path / "file").write_text("x")
    for value in (tmp_path / "missing", tmp_path / "file"):
        assert main(["serve", "--lora-source-root", str(value)]) == 2
        assert "--lora-source-root" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value", ["s3://", "s3://UPPER", "s3://b/../x", "gs://bucket/x", "ftp://x"]
)
def test_serve_refuses_an_object_store_root_it_cannot_read(value, capsys):
    from frontend.cli import main

    assert main(["serve", "--lora-source-root", value]) == 2
    assert "--lora-source-root" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "0.05", "301", "nan", "inf", "soon", ""])
def test_serve_refuses_bad_source_timeouts(value, capsys):
    from frontend.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--lora-source-timeout-s", value])
    assert exit_.value.code == 2
    assert "--lora-source-timeout-s" in capsys.readouterr().err


def test_an_object_store_root_reaches_the_config():
    from frontend.cli import lora_source_root

    assert lora_source_root("s3://my-bucket/adapters") == "s3://my-bucket/adapters"
