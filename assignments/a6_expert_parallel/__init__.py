# Assignment 6: Expert parallel (handout: assignments/a6_expert_parallel.md).
# Generated from tinytrain/parallel/expert_parallel/__init__.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Expert parallel: the experts of every MoE layer split over an EP group; tokens travel to them.

A mixture-of-experts layer (``tinytrain.nn.moe``) sends each token to k of E expert MLPs. Under
expert parallel, rank r of the EP group (P ranks) holds experts [r·E/P, (r+1)·E/P) and every
non-expert weight; each rank of the data group (DP replicas × P) routes its own rows::

    rank r: my tokens (N_r, C) ─ gate (routing.py) ─► top-k experts, weights, whole-batch aux loss
              capacity: the serial GShard queues of the whole batch (routing.py)
              sort kept assignments by expert ─► all-to-all to the experts' owners (dispatch.py)
              owner runs its experts on the tokens from every rank
              all-to-all back ─► y[t] = Σ weight · output                        (dispatch.py)
    backward: the same all-to-alls reversed; after it, every gradient a rank updates is made
              the serial one (model.py, 6.4)

Read in this order: ``routing.py`` (6.1 gate and aux loss, 6.2 capacity, 6.5 the loss-free
balancing bias), ``dispatch.py`` (6.3
dispatch and combine: dropless uneven splits and the capacity-padded equal splits, their bytes),
``model.py`` (``apply_expert_parallel``: how a GPT uses it; 6.4 gradients on a dp × ep mesh).

Every name used elsewhere is re-exported here: ``from tinytrain.parallel.expert_parallel import X``.
"""

from assignments.a6_expert_parallel.dispatch import (
    AllToAll,
    by_expert,
    dropless,
    inverse,
    owned,
    padded,
    wire_bytes,
)
from assignments.a6_expert_parallel.model import (
    VARIANTS,
    ExpertParallel,
    apply_expert_parallel,
)
from assignments.a6_expert_parallel.routing import (
    balance_experts,
    gate,
    gather_over,
    global_capacity,
    global_load,
    keep,
    update_bias,
)

__all__ = [
    "VARIANTS",
    "AllToAll",
    "ExpertParallel",
    "apply_expert_parallel",
    "balance_experts",
    "by_expert",
    "dropless",
    "gate",
    "gather_over",
    "global_capacity",
    "global_load",
    "inverse",
    "keep",
    "owned",
    "padded",
    "update_bias",
    "wire_bytes",
]
