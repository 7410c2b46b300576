"""The layout of a parallel run: how many ranks each strategy gets (``Plan``) and which layouts
cannot work (``Plan.check``, one sentence each, before any rank computes).

The mesh has TP innermost, then CP, EP, PP, DP outermost; ``hybrid.parallelize`` applies the plan to a
model. This module imports nothing that talks between ranks, so the CLI checks flags without MPI.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinytrain.backend import precision_dtype
from tinytrain.nn.recompute import check_mode as check_recompute
from tinytrain.parallel.simulator import chunks_of

# --dp-algo: how the data-parallel replicas combine what they learn (tinytrain/parallel/data_parallel.py)
DP_ALGOS = {
    "allreduce": "gradients averaged by all-reduce every step (BucketedDDP)",
    "ps": "a parameter server: rank 0 averages pushed gradients, updates, workers pull (ParameterServer)",
    "async-ps": "an asynchronous parameter server: each gradient applied as it arrives (AsyncParameterServer)",
    "local-sgd": "--local-steps H steps alone, then the parameters averaged (LocalSGD)",
    "diloco": "local SGD with an outer Nesterov momentum, lr 0.7, momentum 0.9 (LocalSGD.diloco)",
    "fedavg": "federated averaging: --clients with their own data, --local-steps H each per round (federated.FedAvg)",
}
# The flags that mean something only with --dp-algo fedavg, and their defaults.
FED_FLAGS = {
    "clients": None,
    "participation": 1.0,
    "partition": "iid",
    "secure_agg": False,
    "dp_noise": 0.0,
    "clip": None,
    "dp_delta": 1e-5,
}


@dataclass(frozen=True)
class Plan:
    """How many ranks each strategy gets, and its settings. ``Plan()`` is one serial rank."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int | None = None  # per step and replica; default 2 x pp
    chunks: int = 1
    bucket_mb: float = 1.0
    progress: str = "poll"
    cp: int = 1
    cp_algo: str = "ring"
    cp_split: str = "zigzag"
    ep: int = 1
    recompute: str = "none"  # activation recomputation (nn/recompute.py): none, selective, full
    precision: str = "fp32"  # parameters, activations, gradients: fp32, bf16, fp16 (float32 master weights)
    dp_algo: str = "allreduce"  # how replicas share their learning (data_parallel.py): see DP_ALGOS
    local_steps: int = 1  # local-sgd, diloco: inner steps between two averages (H)
    max_staleness: int | None = None  # async-ps: the bound on a gradient's staleness (None: unbounded)
    ps_order: str = "arrival"  # async-ps: serve gradients as they arrive, or in an order drawn from the seed
    seed: int = 0  # (the run's --seed: async-ps --ps-order seeded draws its order from it)
    clients: int | None = None  # fedavg: the clients C (default: one per rank), C/N on each rank
    participation: float = 1.0  # fedavg: the share F of clients in a round (S = round(F·C))
    partition: str = "iid"  # fedavg: iid, or skew:ALPHA (labels split by Dirichlet(ALPHA))
    secure_agg: bool = False  # fedavg: pairwise masks on the updates (secure aggregation)
    dp_noise: float = 0.0  # fedavg with --clip: the noise multiplier σ (DP-FedAvg)
    clip: float | None = None  # fedavg: each client's update clipped to this norm (DP-FedAvg)
    dp_delta: float = 1e-5  # fedavg with --dp-noise: the δ at which ε is reported

    def __post_init__(self):
        object.__setattr__(self, "chunks", chunks_of(self.schedule, self.chunks))  # ZB-V: two, in a V

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or 2 * self.pp

    @property
    def is_serial(self) -> bool:
        return self.world_size == 1 and not self.zero and not self.sp and self.dp_algo != "fedavg"

    @property
    def n_clients(self) -> int:
        return self.clients if self.clients is not None else self.dp

    def flags(self) -> str:
        """The command-line flags of this plan, for messages."""
        sizes = (("dp", self.dp), ("pp", self.pp), ("ep", self.ep), ("cp", self.cp), ("tp", self.tp))
        parts = [f"--{k} {v}" for k, v in sizes if v > 1]
        parts += [f"--microbatches {self.microbatches}"] if self.pp > 1 and self.microbatches else []
        parts += ["--sp"] if self.sp else []
        parts += [f"--zero {self.zero}"] if self.zero else []
        return " ".join(parts) or "(serial)"

    def check(self, world_size: int, config, batch_size: int) -> None:
        """Refuse, before any rank computes, a layout that cannot work: one sentence per reason."""
        for name in ("dp", "tp", "pp", "cp", "ep", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"--microbatches must be at least 1, got {self.microbatches}")
        if self.bucket_mb <= 0:
            raise ValueError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        check_recompute(self.recompute)  # every layout takes every mode: it changes memory, not numbers
        self.check_dp_algo(config)
        precision_dtype(self.precision)  # bf16 is refused on CuPy (it says so)
        if self.sp and self.tp < 2:
            raise ValueError("--sp splits the sequence over the tensor-parallel group: add --tp 2 or more")
        if self.cp > 1 and self.pp > 1:
            raise ValueError(
                "--cp with --pp is not composed here (pipeline stages hand on whole sequences); "
                "use --cp with --dp and --tp"
            )
        if self.cp > 1 and self.sp:
            raise ValueError("--cp and --sp both cut the sequence; use one of them")
        if self.cp > 1:
            self.check_context_parallel(config)
        if self.pp == 1 and (self.chunks != chunks_of(self.schedule) or self.microbatches):
            raise ValueError("--chunks and --microbatches cut the batch for a pipeline: they need --pp 2 or more")
        if self.pp == 1 and self.schedule != Plan.schedule:
            raise ValueError(f"--schedule {self.schedule} orders a pipeline's passes: it needs --pp 2 or more")
        if self.zero == 2 and self.pp > 1:
            raise ValueError(
                "--zero 2 with --pp would reduce-scatter gradients once per micro-batch; pipelines "
                "accumulate micro-batches, so use --zero 1 with --pp (as Megatron-LM and DeepSpeed do), or "
                "--zero 3 (each stage's parameters gathered for the step, gradients reduce-scattered once)"
            )
        if self.ep > 1 and not config.n_experts:
            raise ValueError("--ep places experts on ranks: add --experts (a multiple of --ep)")
        if config.n_experts and self.ep > 1 and config.n_experts % self.ep:
            raise ValueError(
                f"--experts {config.n_experts} does not split over --ep {self.ep}: use a multiple of {self.ep}"
            )
        if config.n_experts and config.dropout and self.dp * self.ep > 1:
            raise ValueError(
                "--dropout inside experts draws its masks over each expert's gathered tokens, whose order "
                "depends on the layout; use --dropout 0 with --experts across ranks"
            )
        if config.n_experts and (self.tp > 1 or self.pp > 1 or self.cp > 1 or self.zero):
            raise ValueError(
                "--experts composes with --dp and --ep only: tensor, pipeline and context parallel and ZeRO "
                "are not composed with the mixture of experts here"
            )
        if world_size != self.world_size:
            raise ValueError(
                f"{self.flags()} needs exactly {self.world_size} ranks (dp x pp x ep x cp x tp): run `mpirun -n "
                f"{self.world_size} tinytrain train {self.flags()} ...` (this run has {world_size})"
            )
        if self.dp_algo == "fedavg":
            self.check_federated(batch_size)
            return
        shards = self.dp * self.ep  # expert-parallel ranks each take their own rows, as replicas do
        if batch_size % (shards * (self.n_microbatches if self.pp > 1 else 1)):
            per = f"{shards} replicas x {self.n_microbatches} micro-batches" if self.pp > 1 else f"{shards} replicas"
            step = shards * (self.n_microbatches if self.pp > 1 else 1)
            raise ValueError(
                f"--batch-size {batch_size} (the global batch) does not split into {per}; use a multiple of {step}"
            )
        if self.pp > 1:  # schedule and split errors name the flags already
            from tinytrain.parallel.pipeline import make_schedule, split_layers

            make_schedule(self.schedule, self.pp, self.n_microbatches, self.chunks)
            if self.schedule == "zb-v" and config.n_layer < 2 * self.pp:
                raise ValueError(
                    f"--schedule zb-v puts two chunks of blocks on each of the {self.pp} stages: use --layers >= "
                    f"{2 * self.pp} (this model has {config.n_layer}), fewer stages, or another schedule"
                )
            split_layers(config.n_layer, self.pp, self.chunks)

    def check_dp_algo(self, config) -> None:
        """--dp-algo, --local-steps, --max-staleness: each only where it means something."""
        algo = self.dp_algo
        if algo not in DP_ALGOS:
            raise ValueError(f"--dp-algo must be one of {', '.join(DP_ALGOS)}, got {algo!r}")
        if self.local_steps < 1:
            raise ValueError(f"--local-steps must be at least 1, got {self.local_steps}")
        if self.max_staleness is not None and (algo != "async-ps" or self.max_staleness < 0):
            raise ValueError("--max-staleness bounds --dp-algo async-ps: give it 0 or more, with --dp-algo async-ps")
        if self.ps_order != "arrival" and algo != "async-ps":
            raise ValueError("--ps-order is the serving order of --dp-algo async-ps: add it, or drop --ps-order")
        if self.local_steps != 1 and algo not in ("local-sgd", "diloco", "fedavg"):
            raise ValueError(
                "--local-steps is the H of --dp-algo local-sgd, diloco or fedavg: add one of them, or drop it"
            )
        if algo == "fedavg":
            self.check_federated()
        else:
            for name, default in FED_FLAGS.items():
                if getattr(self, name) != default:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(
                        f"{flag} is a setting of federated averaging: add --dp-algo fedavg, or drop {flag}"
                    )
        if algo == "allreduce":
            return
        used = {"--tp": self.tp > 1, "--pp": self.pp > 1, "--cp": self.cp > 1, "--ep": self.ep > 1}
        used.update({"--sp": self.sp, "--zero": self.zero, "--experts": config.n_experts})
        other = [flag for flag, on in used.items() if on]
        if other:
            raise ValueError(
                f"--dp-algo {algo} replaces plain data parallel's gradient all-reduce and composes with --dp alone, "
                f"not with {other[0]}: drop {other[0]}, or use --dp-algo allreduce"
            )
        if self.precision != "fp32":
            raise ValueError(f"--dp-algo {algo} is built for --precision fp32 here: drop --precision, or use allreduce")
        if self.dp < 2 and algo != "fedavg":  # (one rank may simulate every client)
            raise ValueError(f"--dp-algo {algo} needs 2 or more replicas: run `mpirun -n N tinytrain train --dp N ...`")

    def check_federated(self, batch_size: int | None = None) -> None:
        """--clients, --participation, --partition, --secure-agg, --dp-noise, --clip: values that work."""
        from tinytrain.parallel.federated import parse_partition, selected_count

        clients = self.n_clients
        if clients < 1:
            raise ValueError(f"--clients must be at least 1, got {clients}")
        if clients % self.dp:
            raise ValueError(
                f"--clients {clients} does not split over --dp {self.dp} ranks (each hosts C/N clients): "
                f"use a multiple of {self.dp}"
            )
        if not 0 < self.participation <= 1:
            raise ValueError(f"--participation is the share of clients in a round, in (0, 1]; got {self.participation}")
        parse_partition(self.partition)
        chosen = selected_count(clients, self.participation)
        if self.secure_agg and chosen < 2:
            raise ValueError(
                f"--secure-agg masks each update with the other clients of the round, but a round has {chosen} "
                "(one client's masked update is its update): raise --participation or --clients"
            )
        if not self.dp_noise >= 0:
            raise ValueError(f"--dp-noise is the noise multiplier σ, 0 or more; got {self.dp_noise}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"--clip is the norm each client's update is clipped to, positive; got {self.clip}")
        if self.dp_noise and self.clip is None:
            raise ValueError(
                "--dp-noise σ adds noise of σ times the clip bound: add --clip S (each client's update clipped to "
                "norm S)"
            )
        if not 0 < self.dp_delta < 1:
            raise ValueError(f"--dp-delta is the δ of (ε, δ)-privacy, in (0, 1); got {self.dp_delta}")
        if batch_size is not None and batch_size % chosen:
            raise ValueError(
                f"--batch-size {batch_size} (the rows of one local step over the round's clients) does not split "
                f"over the {chosen} clients of a round (--participation {self.participation:g} of {clients}): use a "
                f"multiple of {chosen}"
            )

    def check_context_parallel(self, config) -> None:
        if self.cp_algo not in ("ring", "alltoall") or self.cp_split not in ("zigzag", "contiguous"):
            raise ValueError(
                f"--cp-algo ring|alltoall and --cp-split zigzag|contiguous, got {self.cp_algo}, {self.cp_split}"
            )
        chunks = 2 * self.cp if self.cp_split == "zigzag" else self.cp
        if config.block_size % chunks:
            raise ValueError(
                f"--cp {self.cp} --cp-split {self.cp_split} cuts each sequence into {chunks} equal chunks, but a "
                f"sequence has {config.block_size} tokens: choose --block-size (text data) or --digits so that it is "
                f"a multiple of {chunks}, or another --cp"
            )
        if self.cp_algo == "alltoall" and config.n_head % (self.tp * self.cp):
            raise ValueError(
                f"--cp-algo alltoall gives each of the {self.cp} context ranks whole heads: --heads {config.n_head} "
                f"(over --tp {self.tp}) does not split; use --heads divisible by {self.tp * self.cp} or --cp-algo ring"
            )

    def mesh(self):
        """The device mesh {dp, pp, ep, cp, tp} of this plan over the world (TP innermost)."""
        from tinytrain import distributed as dist

        return dist.DeviceMesh({"dp": self.dp, "pp": self.pp, "ep": self.ep, "cp": self.cp, "tp": self.tp})
