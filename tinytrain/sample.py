"""``tinytrain sample``: continue a prompt with a trained model from a checkpoint."""

from __future__ import annotations

import argparse
import math

import numpy

from tinytrain import checkpoint
from tinytrain.autograd import no_grad
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, GPTConfig


def generate(model: GPT, ids, new_tokens: int, temperature: float = 0.0, rng=None):
    """Append ``new_tokens`` tokens to each row of ``ids`` (B, T); greedy when temperature is 0.

    Returns only the new tokens (B, new_tokens) as a NumPy array. The context is cut to the
    model's block size; there is no key/value cache: each token reruns the whole context.
    """
    was_training = model.training
    model.eval()
    ids = numpy.asarray(ids)
    out = []
    with no_grad():
        for _ in range(new_tokens):
            context = ids[:, -model.config.block_size :]
            logits = to_host(model(xp.asarray(context)).data[:, -1, :]).astype(numpy.float64)
            if temperature <= 0:
                nxt = logits.argmax(axis=-1)
            else:
                p = numpy.exp((logits - logits.max(axis=-1, keepdims=True)) / temperature)
                p /= p.sum(axis=-1, keepdims=True)
                rng = rng or numpy.random.default_rng()
                nxt = numpy.array([rng.choice(len(row), p=row) for row in p])
            out.append(nxt)
            ids = numpy.concatenate([ids, nxt[:, None]], axis=1)
    model.train(was_training)
    return numpy.stack(out, axis=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt", default="runs/latest/ckpt", help="checkpoint folder written by `tinytrain train` (any layout)"
    )
    p.add_argument("--prompt", default=None, help="text to continue (default: a validation problem or a newline)")
    p.add_argument("--tokens", type=int, default=None, help="how many tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)


def checkpoint_model(folder):
    """The serial GPT of a checkpoint folder (whatever layout wrote it), and the checkpoint's meta."""
    reader = checkpoint.Reader(folder)
    model = GPT(GPTConfig(**reader.meta["model_config"]))
    model.load_state_dict({name: reader.read(name) for name, _ in model.named_parameters()})
    return model, reader.meta


def check_args(args) -> None:
    """Reject impossible settings with a message that says what to change."""
    if args.tokens is not None and args.tokens <= 0:
        raise ValueError(f"--tokens must be positive, got {args.tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be 0 (greedy) or positive, got {args.temperature}")


def run(args) -> int:
    from tinytrain.data import load_dataset

    check_args(args)
    model, meta = checkpoint_model(args.ckpt)
    saved = meta["args"]
    dataset = load_dataset(saved.get("data"), saved.get("block_size"), saved.get("digits", 2))
    if args.prompt is None:
        if dataset.name == "addition":
            x, _ = dataset.batch("val", 1, seed=args.seed, step=0)
            args.prompt = dataset.decode(x[0, : dataset.prompt_len])
        else:
            args.prompt = dataset.decode(dataset.splits["val"][:1])
    n = args.tokens or (dataset.seq_len - dataset.prompt_len if dataset.name == "addition" else 200)
    ids = dataset.encode(args.prompt)[None, :]
    new = generate(model, ids, n, args.temperature, numpy.random.default_rng(args.seed))
    text = dataset.decode(new[0])
    whole_problem = dataset.name == "addition" and len(args.prompt) == dataset.prompt_len and args.prompt.endswith("=")
    if whole_problem and text.isdigit():  # the answer is written least-significant digit first
        print(f"{args.prompt}{text}   (the model's sum: {int(text[::-1])})")
    else:
        print(args.prompt + text)
    return 0
