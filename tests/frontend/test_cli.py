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


def test_serve_refuses_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--dtype", "int8"])
    assert exit_.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_serve_turns_prefix_caching_off():
    assert _engine().cache.prefix_caching is True
    assert _engine("--no-prefix-caching").cache.prefix_caching is False
