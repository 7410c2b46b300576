"""The planner's bytes per step against one measured training step of each layout the CLI runs
(issue 13, Must-hold 4): integer bytes by (group, op), summed over the ranks, equal exactly.

Each step is ``planner.measure_step``: the model ``tinytrain train`` builds (``parallelize`` of a
GPT under the plan), one ``forward_backward``, the gradient clipping ``tinytrain train`` does by
default (``--grad-clip 1``) and the optimizer ``step``, counted by ``comm_stats``."""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain import planner
from tinytrain.nn import GPTConfig
from tinytrain.parallel import costs
from tinytrain.parallel.plan import Plan
from tinytrain.planner.layouts import ACTIVATION_BYTES

# 4 layers and 4 heads, so that --pp 4, --tp 4 and --cp-algo alltoall all split it
CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=4, n_embd=32)
SPEC = planner.ModelSpec(layers=4, hidden=32, heads=4, vocab=16, seq=8, batch=8)


def measured_bytes(plan: Plan) -> dict:
    """Bytes each (group, op) sent in one step of ``plan``, summed over the ranks (every rank gets it)."""
    stats, _ = planner.measure_step(plan, CONFIG, batch_size=SPEC.batch, max_norm=1.0)
    mine = {k for k in stats.rows if k[1] != "debug_check"}  # the test harness's signature checks
    keys = sorted(set().union(*dist.world().comm.allgather(mine)))  # a middle stage lacks some
    sent = np.array([stats.sent(op, group) for group, op in keys], dtype=np.int64)
    total = dist.all_reduce(sent)
    return {k: int(v) for k, v in zip(keys, total) if v}  # a recv sends nothing


LAYOUTS = {
    "--dp 4 --zero 3": (Plan(dp=4, zero=3), dict(dp=4, zero=3)),
    "--tp 4": (Plan(tp=4), dict(tp=4)),
    "--tp 4 --sp": (Plan(tp=4, sp=True), dict(tp=4, sp=True)),
    "--dp 2 --tp 2": (Plan(dp=2, tp=2), dict(dp=2, tp=2)),
    "--dp 2 --tp 2 --sp": (Plan(dp=2, tp=2, sp=True), dict(dp=2, tp=2, sp=True)),
    "--pp 4 (1f1b)": (Plan(pp=4), dict(pp=4)),
    "--pp 4 --schedule gpipe --microbatches 4": (
        Plan(pp=4, schedule="gpipe", microbatches=4),
        dict(pp=4, microbatches=4),
    ),
    "--dp 2 --pp 2 --microbatches 2": (Plan(dp=2, pp=2, microbatches=2), dict(dp=2, pp=2, microbatches=2)),
    "--dp 2 --pp 2 --schedule gpipe": (Plan(dp=2, pp=2, schedule="gpipe"), dict(dp=2, pp=2)),
    "--cp 4 (ring)": (Plan(cp=4), dict(cp=4)),
    "--cp 4 --cp-algo alltoall": (Plan(cp=4, cp_algo="alltoall"), dict(cp=4, cp_algo="alltoall")),
}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("flags", list(LAYOUTS))
def test_planner_bytes_equal_a_measured_step(flags):
    plan, layout = LAYOUTS[flags]
    measured = measured_bytes(plan)
    want = planner.run_bytes(SPEC, **layout, clip=True)
    assert measured == want, f"{flags}: measured {measured}, planner {want}"


@pytest.mark.world_size(4)
def test_tensor_parallel_bytes_are_the_blocks_plus_embedding_and_loss():
    """--tp 4: the blocks' 8(t-1)/t·A per layer are not all; the vocabulary-parallel embedding,
    the tied head and the cross-entropy add 2 all-reduces of A and 3 of one number per token."""
    t, rows = 4, SPEC.batch
    activation, tokens = rows * SPEC.seq * SPEC.hidden * 4, rows * SPEC.seq * 4
    measured = measured_bytes(Plan(tp=t))[("tp", "all_reduce")]
    blocks = t * SPEC.layers * costs.tensor_parallel_volume(activation, t)
    edges = t * costs.vocab_parallel_volume(activation, tokens, t)["all_reduce"]
    clipping = t * 2 * 8  # the clipping's sum of squares of the TP shards: one float64, recursive doubling
    assert measured == blocks + edges + clipping
    assert edges == t * 1.5 * (2 * activation + 3 * tokens)  # ring all-reduces on 4 ranks: 2(n-1)/n = 1.5


def test_refuses_layouts_it_does_not_model():
    with pytest.raises(ValueError, match="exact for"):
        planner.run_bytes(SPEC, tp=2, pp=2)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("experts, top_k", [(4, 2), (8, 1)])
def test_expert_parallel_bytes_are_the_formula_on_the_measured_routing(monkeypatch, experts, top_k):
    """--experts E --ep 4 (dropless): how many rows leave their rank depends on the routing the
    step drew, so the formula is evaluated on the counts this step's dispatch sent (read as it
    runs, the bytes left to the counters); every other byte follows from the shapes alone."""
    from tinytrain.parallel.expert_parallel import model as ep_model

    away, dispatch = [], ep_model.dropless

    def counted(moe, rows, counts, group):  # the real dispatch; note the rows sent to other ranks
        outputs, send, recv = dispatch(moe, rows, counts, group)
        away.append(sum(n for p, n in enumerate(send) if p != dist.get_rank(group)))
        return outputs, send, recv

    monkeypatch.setattr(ep_model, "dropless", counted)
    config = GPTConfig(**{**CONFIG.__dict__, "n_experts": experts, "moe_top_k": top_k})
    stats, _ = planner.measure_step(Plan(ep=4), config, batch_size=SPEC.batch, max_norm=1.0)
    keys = [("ep", "all_to_all"), ("ep", "all_gather"), ("ep", "all_reduce")]
    assert {k for k in stats.rows if k[1] != "debug_check" and stats.sent(k[1], k[0])} == set(keys)
    totals = dist.all_reduce(np.array([stats.sent(op, group) for group, op in keys] + [sum(away)], dtype=np.int64))
    measured, rows_away = dict(zip(keys, (int(v) for v in totals[:3]))), int(totals[3])
    assert len(away) == SPEC.layers and 0 < rows_away < SPEC.batch * SPEC.seq * top_k * SPEC.layers
    spec = planner.ModelSpec(**{**SPEC.__dict__, "experts": experts, "top_k": top_k})
    want = planner.run_bytes(spec, ep=4, rows_away=rows_away, clip=True)
    assert measured == want, f"measured {measured}, planner {want} ({rows_away} rows left their rank)"
    # even routing (the planner's estimate) sends (ep-1)/ep of the rows away; this step's differ from it
    even = planner.run_bytes(spec, ep=4, clip=True)[("ep", "all_to_all")] - measured[("ep", "all_to_all")]
    assert even == 4 * SPEC.hidden * 4 * (SPEC.batch * SPEC.seq * top_k * SPEC.layers * 3 / 4 - rows_away)


@pytest.mark.parametrize(
    "layout, part, key, flags",
    [
        (planner.Layout(tp=4, microbatch=8), "tensor_parallel", ("tp", "all_reduce"), dict(tp=4)),
        (planner.Layout(dp=2, tp=2, microbatch=4), "tensor_parallel", ("tp", "all_reduce"), dict(dp=2, tp=2)),
        (planner.Layout(cp=4, microbatch=8), "context_parallel", ("cp", "send"), dict(cp=4)),
    ],
)
def test_tinytrain_plans_bytes_are_the_measured_ones_in_fp32(layout, part, key, flags):
    """`tinytrain plan` counts 16-bit activations per GPU; at 4 bytes, times the GPUs, its TP and CP
    bytes are run_bytes', which the tests above measure (the same formulas of costs.py)."""
    row = planner.estimate(SPEC, planner.Cluster(), layout)
    assert row["microbatches"] == 1
    fp32 = 4 / ACTIVATION_BYTES
    assert row["bytes_sent"][part] * fp32 * layout.gpus == planner.run_bytes(SPEC, **flags)[key]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("schedule, microbatches", [("1f1b", None), ("gpipe", 2)])
def test_planner_bytes_equal_a_measured_two_stage_pipeline(schedule, microbatches):
    """--pp 2 on its own (2 ranks): the boundary messages, the tied gradient swap, the loss."""
    measured = measured_bytes(Plan(pp=2, schedule=schedule, microbatches=microbatches))
    assert measured == planner.run_bytes(SPEC, pp=2, microbatches=microbatches, clip=True)
