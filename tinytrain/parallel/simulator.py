"""Pipeline schedules on paper: the ``Action`` a schedule is made of, and a simulator.

A schedule is ``list[list[Action]]``, one ordered list per stage (see ``pipeline/schedules.py``
for the schedules themselves and the pictures). Which messages an action implies follows from the model
order: chunk c of stage s is *virtual stage* ``c·p + s`` (the ``loop`` placement; ZB-V's ``v``
placement puts chunk 1 of stage s at 2p-1-s: ``virtual_stage``); the forward of virtual stage k
receives from k-1 and sends to k+1, the backward the reverse (no message when both are on one stage).

``simulate`` plays a schedule with given costs, finds deadlocks and backward-before-forward
mistakes, and measures the bubble share and the activations each stage holds, so a schedule can
be checked and drawn before a single message is sent.

A zero-bubble schedule splits each backward in two (``autograd.backward_inputs``): ``B`` computes
the gradient of the stage's input (the previous stage waits for it) and ``W`` the weight
gradients (nobody waits for them). ``backward_cost`` is the whole backward's; of it ``W`` costs
``weight_cost`` (default half) and ``B`` the rest. A micro-batch's activations are held from its
``F`` until its backward is complete: its ``W`` when split, else its ``B``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward, "B" backward (of the input only, when a "W" follows), "W" weights
    microbatch: int
    chunk: int = 0

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    """The schedule cannot run: it deadlocks, or runs a backward before its forward."""


@dataclass
class Timeline:
    stages: int
    chunks: int
    events: list  # (stage, Action, start, end)
    makespan: float
    bubble_share: float
    peak_activations: list  # per stage: most micro-batch chunks held at once (from F to W, or to B)

    def rows(self) -> list:
        """The events as plain tuples (stage, kind, microbatch, chunk, start, end), for tinytrain.viz."""
        return [(st, a.kind, a.microbatch, a.chunk, start, end) for st, a, start, end in self.events]

    def busy(self, stage: int) -> float:
        return sum(e - s for st, _, s, e in self.events if st == stage)


PLACEMENTS = ("loop", "v")


def virtual_stage(stage: int, chunk: int, stages: int, placement: str = "loop") -> int:
    """Which model part chunk ``chunk`` of ``stage`` is. ``loop`` (interleaved 1F1B): chunk c of
    stage s is part c·p + s, the model goes round the stages v times. ``v`` (ZB-V, two chunks):
    chunk 0 of stage s is part s and chunk 1 part 2p-1-s, the model goes down the stages and back up,
    so stage 0 holds the first and the last part."""
    if placement == "v":
        return stage if chunk == 0 else 2 * stages - 1 - stage
    return chunk * stages + stage


def placement_of(schedule: str) -> str:
    """Where a schedule's chunks sit (``virtual_stage``): ``v`` for ZB-V, else ``loop``."""
    return "v" if schedule == "zb-v" else "loop"


def chunks_of(schedule: str, chunks: int = 1) -> int:
    """The model chunks per stage a schedule runs: ZB-V's two for the default 1 (any other count is
    refused by ``pipeline.make_schedule``), else ``chunks`` (interleaved's choice)."""
    return 2 if schedule == "zb-v" and chunks == 1 else chunks


def stage_of(virtual: int, stages: int, placement: str = "loop") -> int:
    """The stage holding model part ``virtual`` (the inverse of ``virtual_stage``)."""
    if placement == "v" and virtual >= stages:
        return 2 * stages - 1 - virtual
    return virtual % stages


def _dependency(stage, action, stages, n_virtual, placement):
    """The pass (virtual stage, kind, micro-batch) that must finish first, or None."""
    k = virtual_stage(stage, action.chunk, stages, placement)
    if action.kind == "W":  # its own B, earlier in the same stage's list (validate checks)
        return None
    if action.kind == "F":
        return (k - 1, "F", action.microbatch) if k > 0 else None
    if k < n_virtual - 1:
        return (k + 1, "B", action.microbatch)
    return (k, "F", action.microbatch)  # the last stage turns its own forward around


def validate(schedule, chunks: int = 1) -> None:
    """Every pass appears once, a stage runs B of a micro-batch chunk after its F and W after its
    B, and a stage splits either every backward into B and W or none."""
    stages = len(schedule)
    for s, actions in enumerate(schedule):
        seen = set()
        for a in actions:
            if a.kind not in ("F", "B", "W"):
                raise ScheduleError(f"stage {s} runs {a}: an action is F, B or W")
            if a in seen:
                raise ScheduleError(f"stage {s} runs {a} twice")
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and Action(before, a.microbatch, a.chunk) not in seen:
                chunk = f".{a.chunk}" if a.chunk else ""
                raise ScheduleError(f"stage {s} runs {a} before {before}{a.microbatch}{chunk}")
            if not 0 <= a.chunk < chunks:
                raise ScheduleError(f"stage {s}: {a} names chunk {a.chunk}, but there are {chunks} chunks")
            seen.add(a)
        weights = {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}
        if weights and weights != {(a.microbatch, a.chunk) for a in actions if a.kind == "B"}:
            raise ScheduleError(f"stage {s} splits some backwards into B and W but not all")
    forwards = [{(a.microbatch, a.chunk) for a in actions if a.kind == "F"} for actions in schedule]
    if any(f != forwards[0] for f in forwards):
        raise ScheduleError("stages run different sets of micro-batches")
    del stages


def simulate(
    schedule,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    comm_cost: float = 0.0,
    chunks: int = 1,
    weight_cost: float | None = None,
    placement: str = "loop",
) -> Timeline:
    """Play ``schedule`` with per-pass costs (a chunk's pass costs 1/chunks of a stage's).
    ``backward_cost`` is a whole backward's; split into B and W, ``weight_cost`` of it is W's
    (default half). ``placement`` says which model part each chunk is (``virtual_stage``).

    Each stage runs its actions in order, each as soon as the stage is free and the pass it
    depends on has finished (plus ``comm_cost`` when that pass ran on another stage). Sends never
    block (as with ``isend``), so a schedule deadlocks only if its waits form a cycle.
    """
    validate(schedule, chunks)
    if placement not in PLACEMENTS or (placement == "v" and chunks != 2):
        raise ValueError(f"placement is 'loop' (any chunks) or 'v' (2 chunks), got {placement!r} with {chunks} chunks")
    stages = len(schedule)
    n_virtual = stages * chunks
    w = backward_cost / 2 if weight_cost is None else weight_cost
    split = [any(a.kind == "W" for a in actions) for actions in schedule]
    cost = [
        {"F": forward_cost / chunks, "B": (backward_cost - (w if sp else 0.0)) / chunks, "W": w / chunks}
        for sp in split
    ]
    done: dict = {}  # (virtual stage, kind, microbatch) -> finish time
    position = [0] * stages
    free_at = [0.0] * stages
    held, peak = [0] * stages, [0] * stages
    events = []
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for s in range(stages):
            while position[s] < len(schedule[s]):
                a = schedule[s][position[s]]
                dep = _dependency(s, a, stages, n_virtual, placement)
                if dep is not None and dep not in done:
                    break
                remote = dep is not None and stage_of(dep[0], stages, placement) != s
                ready = 0.0 if dep is None else done[dep] + (comm_cost if remote else 0.0)
                start = max(free_at[s], ready)
                end = start + cost[s][a.kind]
                done[(virtual_stage(s, a.chunk, stages, placement), a.kind, a.microbatch)] = end
                free_at[s] = end
                events.append((s, a, start, end))
                held[s] += 1 if a.kind == "F" else -1 if a.kind == ("W" if split[s] else "B") else 0
                peak[s] = max(peak[s], held[s])
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [(s, schedule[s][position[s]]) for s in range(stages) if position[s] < len(schedule[s])]
            waiting = [
                f"stage {s} at {a} waits for "
                f"{_describe(_dependency(s, a, stages, n_virtual, placement), stages, placement)}"
                for s, a in stuck
            ]
            raise ScheduleError("the schedule deadlocks: " + "; ".join(waiting))
    makespan = max(free_at)
    busy = sum(e - st for _, _, st, e in events)
    return Timeline(stages, chunks, events, makespan, 1.0 - busy / (stages * makespan), peak)


def _describe(dep, stages, placement):
    k, kind, mb = dep
    return f"{kind}{mb} of virtual stage {k} (stage {stage_of(k, stages, placement)}, chunk {k // stages})"


def bubble_formula(stages: int, microbatches: int, chunks: int = 1, schedule: str = "1f1b") -> float:
    """The textbook bubble share for free messages: (p-1)/(v·m + p-1) for GPipe, 1F1B and
    interleaved (any ratio of forward to backward cost); with F = B = W (each a third of a forward
    plus backward) ZB-H1's (p-1)/(3m + p-1) and ZB-V's (p-1)/(6m + p-1), both for m >= p."""
    if schedule == "zb-h1":
        return (stages - 1) / (3 * microbatches + stages - 1)
    if schedule == "zb-v":
        return (stages - 1) / (6 * microbatches + stages - 1)
    return (stages - 1) / (chunks * microbatches + stages - 1)
