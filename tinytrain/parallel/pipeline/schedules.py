"""Schedules as data: which forward (F) and backward (B) passes each stage runs, and in what order.

A pipeline of ``p`` stages trains ``m`` micro-batches per step. A schedule is ``list[list[Action]]``,
one list per stage; an ``Action`` names one pass (kind, micro-batch, chunk). Nothing here sends a
message: the executor (``executor.py``) turns each action into compute and messages, and
``simulator.py`` plays a schedule on paper (bubble share, peak activations, deadlocks).

    GPipe, p=4, m=4 (time →; numbers are micro-batches; · is a bubble)

    stage 0  F0 F1 F2 F3 ·  ·  ·  ·  ·  ·  B0 B1 B2 B3
    stage 1  ·  F0 F1 F2 F3 ·  ·  ·  ·  B0 B1 B2 B3 ·
    stage 2  ·  ·  F0 F1 F2 F3 ·  ·  B0 B1 B2 B3 ·  ·
    stage 3  ·  ·  ·  F0 F1 F2 F3 B0 B1 B2 B3 ·  ·  ·     (B drawn as long as F here)

Every stage idles for p-1 slots of F and p-1 slots of B, so with equal costs the *bubble share*
(idle time / total time) is (p-1)/(m+p-1). More micro-batches shrink it.

1F1B runs the same work in another order: after a few warm-up forwards, each stage alternates
one forward and one backward, then drains. The bubble is the same, but a stage never holds more than p-s
micro-batches' activations at once instead of all m: memory is what 1F1B buys.

    1F1B, p=4, m=4

    stage 0  F0 F1 F2 F3 ·  ·  ·  B0 ·  B1 ·  B2 ·  B3     holds at most 4 micro-batches
    stage 1  ·  F0 F1 F2 ·  ·  B0 F3 B1 ·  B2 ·  B3 ·                   3
    stage 2  ·  ·  F0 F1 ·  B0 F2 B1 F3 B2 ·  B3 ·  ·                   2
    stage 3  ·  ·  ·  F0 B0 F1 B1 F2 B2 F3 B3 ·  ·  ·                   1

Interleaved 1F1B gives each stage v model *chunks* (stage s holds chunks s, s+p, s+2p, ...), so a
micro-batch passes every stage v times, each pass 1/v as long. Filling and draining the pipe then
costs (p-1)/v of a full pass: the bubble share becomes (p-1)/(v·m+p-1), at the price of v times
as many messages. Chunk c of stage s is *virtual stage* ``c·p + s``.

Zero bubble (Qi et al., 2024) splits each backward in two (``autograd.backward_inputs``): B, the
gradient of the stage's input, which the previous stage waits for, and W, the weight gradients,
which nobody waits for until the optimizer step. W can then fill the bubbles. ZB-H1 keeps 1F1B's
forwards and backwards (B where 1F1B runs its backward) and places the W's so that they fill 1F1B's
cool-down (the handout states the paper's rule). With F = B = W a stage idles (p-1)(F + B - W)
instead of 1F1B's (p-1)(F + B + W): the bubble share is (p-1)/(3m + p-1) for m >= p, against
1F1B's 3(p-1)/(3m + 3(p-1)) = (p-1)/(m+p-1), about a third. A micro-batch's activations stay until
its W, so every stage holds up to p of them: 1F1B's peak (its stage 0's), now on every stage.

ZB-V gives each stage two chunks placed in a V: chunk 0 of stage s is model part s, chunk 1 is part
2p-1-s, so a micro-batch goes down the stages and comes back up, and stage 0 holds both the first
part (the embedding) and the last (the loss). Each chunk's pass is half a stage's. At the bottom of
the V (stage p-1 holds parts p-1 and p) the activation turns round on the same rank: no message.
Warm-up, stage s: chunk-0 forwards until micro-batch 0 comes back up (2(p-s)-1 of them), then s
pairs of chunk-1 and chunk-0 forwards, then micro-batches reach the loss and turn back; steady
state F B on chunk 0, then on chunk 1. Each W comes as late as memory allows: a stage runs its
oldest waiting W only when another forward would hold more than 2p chunks (1F1B's stage-0 peak,
p micro-batches), and in the cool-down each W waits s backwards.

    ZB-V, p=3, m=6, F = B = W per chunk (capitals: chunk 0; f b w: chunk 1)

    s0 F0 F1 F2 F3 F4 f0 b0 w0 f1 b1 w1 f2 b2 w2 F5 B0 W0 f3 b3 ·  B1 w3 f4 b4 ·  B2 W1 f5 b5 B3 w4 W2 w5 W3 B4 W4 B5 W5
    s1 ·  F0 F1 F2 f0 F3 f1 b0 w0 f2 b1 w1 F4 B0 W0 f3 b2 w2 F5 B1 W1 f4 b3 ·  B2 w3 f5 b4 B3 W2 w4 b5 W3 B4 w5 B5 W4 W5
    s2 ·  ·  F0 f0 F1 f1 F2 f2 b0 w0 F3 B0 W0 f3 b1 w1 F4 B1 W1 f4 b2 w2 F5 B2 W2 f5 b3 B3 b4 w3 B4 W3 b5 w4 B5 W4 w5 W5

A stage's work is 6m chunk passes; the idle time left is what the first forward's way down costs,
p-1 passes on every stage (stage s waits s at the start, p-1-s later): with F = B = W the bubble
share is (p-1)/(6m + p-1) for m >= p (fewer micro-batches: above it), half of ZB-H1's idle time.
The paper calls it zero: its stages' busy times form a parallelogram, and with the optimizer
step's checks moved after the step ("post-validation") one step's cool-down overlaps the next
step's warm-up. A step measured on its own, as here (tinytrain clips gradients and averages the
loss between steps), keeps those p-1 passes. Every stage holds up to 2p chunks' activations, p
micro-batches' worth: 1F1B's peak, on every stage. The price is messages: 2p-2 boundaries crossed
each way instead of p-1.
"""

from __future__ import annotations

from tinytrain.parallel.simulator import Action, Timeline, chunks_of, placement_of, simulate


def _check(stages: int, microbatches: int, chunks: int = 1) -> None:
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(f"need stages, microbatches and chunks >= 1, got {stages}, {microbatches}, {chunks}")


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards, on every stage."""
    _check(stages, microbatches)
    # BEGIN SOLUTION 5.2 "Every stage runs all forward passes in micro-batch order, then all backward passes in the same order." full="Every stage: F0..F(m-1), then B0..B(m-1)."
    return [
        [Action("F", i) for i in range(microbatches)] + [Action("B", i) for i in range(microbatches)]
        for _ in range(stages)
    ]
    # END SOLUTION


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): the same passes as GPipe, with stage s holding at most p-s micro-batches."""
    _check(stages, microbatches)
    # BEGIN SOLUTION 5.3 "The same passes as GPipe, ordered so that each stage starts its backwards as early as it can and holds as few micro-batches at once as the pipeline allows." full="Stage s: min(p-1-s, m) warm-up forwards, then pairs (F next, B oldest), then the remaining B."
    schedule = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    return schedule
    # END SOLUTION


def interleaved_1f1b(stages: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """1F1B over virtual stages (Megatron-LM's interleaved schedule): ``chunks`` per stage, each
    action naming its chunk. Needs ``microbatches`` to be a multiple of ``stages``."""
    _check(stages, microbatches, chunks)
    if microbatches % stages:
        raise ValueError(
            f"interleaved 1F1B sends micro-batches in groups of {stages} (the number of stages); "
            f"{microbatches} micro-batches is not a multiple of {stages}: "
            f"choose e.g. {stages * max(1, microbatches // stages)}"
        )
    # BEGIN SOLUTION 5.4 "1F1B over the virtual stages, as Megatron's interleaved schedule orders them (m a multiple of p)." full="Number the passes k = 0..m·v-1: chunk (k mod pv)//p, micro-batch (k//pv)·p + k mod p; backwards reverse the chunk; warm-up 2(p-1-s) + (v-1)p."
    total = microbatches * chunks
    group = stages * chunks

    def nth(k: int, kind: str) -> Action:
        chunk = (k % group) // stages
        microbatch = (k // group) * stages + k % stages
        return Action(kind, microbatch, chunk if kind == "F" else chunks - 1 - chunk)

    schedule = []
    for s in range(stages):
        warmup = total if microbatches == stages else min(total, (stages - 1 - s) * 2 + (chunks - 1) * stages)
        actions = [nth(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            actions += [nth(warmup + k, "F"), nth(k, "B")]
        actions += [nth(k, "B") for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule
    # END SOLUTION


def zb_h1(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into B and W, the W's filling the bubbles."""
    _check(stages, microbatches)
    # BEGIN SOLUTION 5.6 "ZB-H1 as the paper orders it: 1F1B's forwards and input-gradient passes, each stage's weight passes placed by the rule the handout states." full="Walk one_f_one_b's list of stage s; after B j append W (j - s) when j >= s; end with W (m - s) .. W (m - 1)."
    schedule = []
    for s, actions in enumerate(one_f_one_b(stages, microbatches)):
        split = []
        for a in actions:
            split.append(a)
            if a.kind == "B" and a.microbatch >= s:
                split.append(Action("W", a.microbatch - s))
        split += [Action("W", j) for j in range(max(0, microbatches - s), microbatches)]
        schedule.append(split)
    return schedule
    # END SOLUTION


def zb_v(stages: int, microbatches: int) -> list[list[Action]]:
    """Zero bubble in a V: chunk 0 of stage s is model part s, chunk 1 part 2p-1-s; backwards split
    into B and W. Simulate and run it with ``placement="v"`` (``placement_of("zb-v")``)."""
    _check(stages, microbatches)
    most = 2 * stages  # chunks' activations a stage may hold: 1F1B's stage-0 peak, p micro-batches
    schedule = []
    for s in range(stages):
        actions, done, waiting = [], {}, []  # done[(kind, chunk)]: micro-batches run; waiting: B run, W not

        def take(kind, chunk) -> None:
            i = done.get((kind, chunk), 0)
            actions.append(Action(kind, i, chunk))
            done[(kind, chunk)] = i + 1

        def left(kind, chunk) -> bool:
            return done.get((kind, chunk), 0) < microbatches

        def held() -> int:
            return sum(done.get(("F", c), 0) - done.get(("W", c), 0) for c in (0, 1))

        def run(*passes) -> None:  # the next micro-batch of each pass, in order (none once all m ran)
            for kind, chunk in passes:
                if not left(kind, chunk):
                    continue
                while kind == "F" and held() >= most and waiting:  # a W as late as memory allows
                    take("W", waiting.pop(0))
                take(kind, chunk)
                if kind == "B":
                    waiting.append(chunk)

        for _ in range(2 * (stages - s) - 1):  # chunk 0 only, until micro-batch 0 comes back up
            run(("F", 0))
        for _ in range(s):
            run(("F", 1), ("F", 0))
        for _ in range(stages - s):  # the first micro-batches reach the loss and turn back
            run(("F", 1), ("B", 1))
        while left("F", 1):  # steady state: one micro-batch of each pass on both chunks
            run(("F", 0), ("B", 0), ("F", 1), ("B", 1))
        while left("B", 0) or left("B", 1):  # cool-down: each W waits s backwards, filling the wait for the next B
            for chunk in (0, 1):
                if left("B", chunk):
                    run(("B", chunk))
                    while len(waiting) > s:
                        take("W", waiting.pop(0))
        for chunk in waiting:
            take("W", chunk)
        schedule.append(actions)
    return schedule


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb-h1": zb_h1, "zb-v": zb_v}


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """Schedule ``name`` with ``chunks`` per stage (``chunks_of``)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(stages, microbatches, chunks)
    if name == "zb-v":
        if chunks_of(name, chunks) != 2:
            raise ValueError(f"--schedule zb-v runs two chunks per stage in a V; drop --chunks {chunks}")
        return zb_v(stages, microbatches)
    if chunks != 1:
        raise ValueError(f"--chunks {chunks} needs --schedule interleaved ({name} runs one chunk per stage)")
    return SCHEDULES[name](stages, microbatches)


def simulate_schedule(name: str, stages: int, microbatches: int, chunks: int = 1, **costs) -> Timeline:
    """Schedule ``name`` played by ``simulator.simulate`` (``costs``: its cost arguments) on the
    chunks and placement it runs with."""
    chunks = chunks_of(name, chunks)
    schedule = make_schedule(name, stages, microbatches, chunks)
    return simulate(schedule, chunks=chunks, placement=placement_of(name), **costs)
