"""Tracing: spans per rank with op, group, peer and bytes; merged on rank 0; Chrome JSON."""

import json

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain import trace


@pytest.fixture
def tracing():
    trace.clear()
    trace.enable()
    yield
    trace.enable(False)
    trace.clear()


def test_tracing_is_off_by_default_and_records_nothing():
    assert not trace.enabled
    before = len(trace.spans())
    with trace.span("forward"):
        dist.all_reduce(np.ones(4))
    trace.record("x", "compute", 0.0, 1.0)
    assert len(trace.spans()) == before


@pytest.mark.world_size(4)
def test_collectives_and_p2p_record_spans_merged_on_rank_0(tracing, tmp_path):
    r, n = dist.get_rank(), dist.get_world_size()
    with trace.span("compute block", cat="compute", layer=1):
        dist.all_reduce(np.ones(1024, dtype=np.float32), algo="ring")
    dist.sendrecv(np.ones(8), (r + 1) % n, np.empty(8), (r - 1) % n)
    merged = trace.merge()
    if r != 0:
        assert merged is None
        return
    assert {s["rank"] for s in merged} == set(range(n))
    colls = [s for s in merged if s["cat"] == "comm" and s["name"] == "all_reduce"]
    assert len(colls) == n and all(s["args"]["algo"] == "ring" and s["args"]["group"] == "world" for s in colls)
    for s in colls:  # the whole call: its ring neighbours and 2(n-1)/n of the 4 KiB buffer
        assert s["args"]["peer"] == sorted({(s["rank"] - 1) % n, (s["rank"] + 1) % n})
        assert s["args"]["bytes"] == 2 * (n - 1) * 4096 // n
    steps = [s for s in merged if s["cat"] == "comm.step" and s["name"] == "all_reduce" and s["rank"] == 0]
    assert len(steps) == 2 * (n - 1)  # one span per ring step
    assert all(s["args"]["peer"] == [n - 1, 1] and s["args"]["bytes"] == 1024 for s in steps)  # recv left, send right
    p2p = [s for s in merged if s["name"] == "sendrecv"]
    assert len(p2p) == n and all(s["args"]["bytes"] == 64 for s in p2p)
    compute = [s for s in merged if s["cat"] == "compute"]
    assert len(compute) == n and all(s["start"] <= s["end"] for s in compute)
    path = tmp_path / "trace.json"
    trace.write_chrome(str(path), merged)
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(n))
