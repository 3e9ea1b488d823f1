"""bench_quant --servers: the subset of servers a run measures, and the report's ratios when
a llama.cpp peer was left out."""

from __future__ import annotations

import pytest
from common import quant_servers
from common.quant_servers import SERVERS, pick


def test_pick_keeps_table_order_and_refuses_unknown_labels():
    assert pick(SERVERS, None) == SERVERS
    got = pick(SERVERS, " llama.cpp Q4_1 ,punica-x Q4_1")
    assert [s[0] for s in got] == ["punica-x Q4_1", "llama.cpp Q4_1"]
    for bad in ("", " , ", "punica-x Q4_1,nope", "punica-x"):
        with pytest.raises(SystemExit, match="--servers"):
            pick(SERVERS, bad)


def test_report_rates_only_the_servers_whose_peer_ran(monkeypatch, tmp_path):
    monkeypatch.setenv("PUNICA_X_RESULTS", str(tmp_path))
    monkeypatch.setattr(quant_servers, "plot", lambda rows, name: None)
    rate = dict.fromkeys((w + "_tok_s" for w in quant_servers.WORKLOADS), 10.0)
    rows = [
        {"server": "punica-x Q4_1", **rate, "weights_MB": 1.0, "x_file_bytes": 1.0},
        {"server": "punica-x Q8_0", **rate, "weights_MB": 1.0, "x_file_bytes": 1.0},
        {"server": "llama.cpp Q4_1", **rate, "backbone_tok_s": 5.0, "weights_MB": 1.0,
         "x_file_bytes": 1.0},
    ]  # fmt: skip

    class Args:
        model, requests, max_tokens, stream_tokens, rank, threads = None, 32, 64, 128, 16, 2

    quant_servers.report(Args(), rows)
    assert rows[0]["x_backbone"] == 2.0 and rows[0]["x_backbone_vs_fastest"] == 2.0
    assert "x_backbone" not in rows[1]  # no llama.cpp Q8_0 in this run
