"""One readable chapter per parallel strategy, in the lecture's order, and their composition.

wrapper.py (what DDP, the parameter server and ZeRO share)
data_parallel.py (DDP, buckets, parameter server)   zero.py (ZeRO stages 1 < 2 < 3)
tensor_parallel/ (mappings, layers, cross_entropy, model: Megatron TP + SP)
context_parallel/ (merge, ring, ulysses, split, model: ring and all-to-all attention over sequence shards)
expert_parallel/ (routing, dispatch, model: mixture of experts over all-to-all, EP x DP gradients)
pipeline/ (schedules: GPipe, 1F1B, interleaved, ZB-H1, ZB-V; stage, messages, executor; simulator.py: on paper)
plan.py (a layout: how many ranks each strategy gets)   hybrid.py (parallelize: all of them on one mesh)

Nothing here imports the training loop (``tinytrain.trainer``), which sits above.
"""
