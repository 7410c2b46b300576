"""``tinytrain sample``: continue a prompt with a trained model from a checkpoint.

The checkpoint is all it needs: the model, and its vocabulary (the training text's characters and
the default prompt, the validation text's first character; for the addition task, ``--digits``).
So the training text may move, change or go. A checkpoint written before checkpoints kept their
vocabulary rebuilds it from the training text, which must then be where ``--data`` named it, with
as many characters as the model knows (else one sentence says so; an edit that keeps the number of
characters cannot be told there).

Generation keeps a key/value cache (``GPT.decode``): while the context fits in the block size, a
new token costs one position's work. Past it, each token sees the last block_size tokens at
positions 0..block_size-1, as in training: every position moves, so that window is recomputed for
each token (no cache can shift positions). Greedy output equals the uncached generation's.

A run that takes more than a second shows its progress on stderr (a self-rewriting line on a
terminal, a line a second elsewhere); Ctrl-C prints the text generated so far and exits 130.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from array import array
from pathlib import Path

import numpy

from tinytrain import checkpoint
from tinytrain.autograd import no_grad
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, GPTConfig


def generate(model: GPT, ids, new_tokens: int, temperature: float = 0.0, rng=None, *, cache: bool = True):
    """Append ``new_tokens`` tokens to each row of ``ids`` (B, T); greedy when temperature is 0.

    Returns only the new tokens (B, new_tokens) as a NumPy array. The context is cut to the
    model's block size. ``cache``: keep keys and values while the context fits (``GPT.decode``);
    False reruns the whole context for every token (the reference the cache is tested against).
    """
    out = list(generate_tokens(model, ids, new_tokens, temperature, rng, cache=cache))
    return numpy.stack(out, axis=1) if out else numpy.zeros((len(ids), 0), dtype=numpy.int64)


def generate_tokens(model: GPT, ids, new_tokens: int, temperature: float = 0.0, rng=None, *, cache: bool = True):
    """``generate``, one new token of each row (an array (B,)) at a time, as each is drawn."""
    ids = numpy.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"generate needs token ids (batch, time) with at least one token a row, got {ids.shape}")
    if temperature > 0 and rng is None:
        rng = numpy.random.default_rng()
    block = model.config.block_size
    context = ids[:, -block:]
    was_training = model.training
    model.eval()
    try:
        kv = model.kv_cache(len(context)) if cache and hasattr(model, "kv_cache") else None
        for _ in range(new_tokens):
            with no_grad():
                if kv is None:
                    logits = model(xp.asarray(context))
                else:  # the whole prompt into the empty cache, then the newest token alone
                    logits = model.decode(context if kv.length == 0 else context[:, -1:], kv)
            nxt = _pick(to_host(logits.data[:, -1, :]).astype(numpy.float64), temperature, rng)
            yield nxt
            if kv is not None and kv.length == block:
                kv = None  # the window slides from here: every position moves, so each token reruns it
            context = numpy.concatenate([context, nxt[:, None]], axis=1)[:, -block:]
    finally:
        model.train(was_training)


def _pick(logits, temperature: float, rng):
    """The next token of each row of ``logits`` (B, vocab): the largest, or drawn at ``temperature``."""
    if temperature <= 0:
        return logits.argmax(axis=-1)
    p = numpy.exp((logits - logits.max(axis=-1, keepdims=True)) / temperature)
    p /= p.sum(axis=-1, keepdims=True)
    return numpy.array([rng.choice(len(row), p=row) for row in p])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt", default="runs/latest/ckpt", help="checkpoint folder written by `tinytrain train` (any layout)"
    )
    p.add_argument(
        "--prompt",
        default=None,
        help="text to continue (default: a validation problem, or the validation text's first character; "
        "'' starts after a newline)",
    )
    p.add_argument("--tokens", type=int, default=None, help="how many tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)


def checkpoint_model(folder):
    """The serial GPT of a checkpoint folder (whatever layout wrote it), and the checkpoint's meta."""
    reader = checkpoint.Reader(folder)
    model = GPT(GPTConfig(**reader.meta["model_config"]))
    model.load_state_dict({name: reader.read(name) for name, _ in model.named_parameters()})
    return model, reader.meta


def checkpoint_vocabulary(meta: dict, folder):
    """The encoder/decoder of a checkpoint: the vocabulary it keeps, or (an older checkpoint) the
    dataset rebuilt from its training text, refused in one sentence where that text is gone or has
    another number of characters than the model knows."""
    from tinytrain.data import AdditionDataset, from_description, load_dataset

    if meta.get("dataset"):
        return from_description(meta["dataset"])
    saved = meta.get("args", {})
    data = saved.get("data")
    if data in (None, "addition"):
        return AdditionDataset(saved.get("digits", 2))
    if not Path(data).is_file():
        raise ValueError(
            f"the checkpoint in {folder} is older than checkpoints that keep their vocabulary, so it needs "
            f"its training text {data}, which is not there; put the text back there"
        )
    dataset = load_dataset(data, saved.get("block_size"), saved.get("digits", 2))
    known = meta["model_config"]["vocab_size"]
    if dataset.vocab_size != known:
        raise ValueError(
            f"the training text {data} has changed since the checkpoint in {folder} was written (it has "
            f"{dataset.vocab_size} different characters, the model knows {known}), and a checkpoint this "
            "old does not keep its vocabulary; put the text it was trained on back"
        )
    return dataset


def choose_prompt(prompt: str | None, dataset, seed: int) -> tuple[str, str]:
    """(the prompt as printed, the text the model continues), or a one-sentence ValueError."""
    from tinytrain.data import char_listing

    addition = dataset.name == "addition"
    if prompt is None:
        if addition:
            x, _ = dataset.batch("val", 1, seed=seed, step=0)
            prompt = dataset.decode(x[0, : dataset.prompt_len])
        else:
            prompt = dataset.prompt
        return prompt, prompt
    if prompt == "":
        if addition:
            raise ValueError(
                "--prompt is empty, but the addition task continues the start of a problem: give one such "
                "as '12+34=' (or leave --prompt out for a validation problem)"
            )
        start, said = ("\n", "a newline") if "\n" in dataset.chars else (dataset.start, f"{dataset.start!r}")
        where = "" if start == "\n" else ", the training text's first character"
        print(f"tinytrain sample: the prompt is empty: generating after {said}{where} (not printed)", file=sys.stderr)
        return "", start
    if not addition:  # the addition task's encode says which characters it has
        unknown = dataset.unknown(prompt)
        if unknown:
            one = len(unknown) == 1
            raise ValueError(
                f"--prompt has {char_listing(unknown)}, {'a character' if one else 'characters'} the model was "
                f"not trained on (it knows the {dataset.vocab_size} characters of its training text); "
                f"leave {'it' if one else 'them'} out"
            )
    return prompt, prompt


def check_args(args) -> None:
    """Reject impossible settings with a message that says what to change."""
    from tinytrain.trainer.runners import launched_world

    ranks = launched_world()[1]
    if ranks > 1:  # every rank would generate the same text and print it on one line
        raise ValueError(
            f"tinytrain sample generates on one process, and this launch has {ranks} ranks: run it without mpirun"
        )
    if args.tokens is not None and args.tokens <= 0:
        raise ValueError(f"--tokens must be positive, got {args.tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be 0 (greedy) or positive, got {args.temperature}")


class Progress:
    """Tokens so far on stderr once a run has taken ``after`` seconds: one self-rewriting line on a
    terminal, a line a second elsewhere; nothing for a short run."""

    def __init__(self, total: int, after: float = 1.0):
        self.total, self.start = total, time.monotonic()
        self.next = self.start + after
        self.tty = sys.stderr.isatty()
        self.shown = False

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + (0.2 if self.tty else 1.0)
        rate = done / (now - self.start)
        left = (self.total - done) / rate
        line = f"tinytrain sample: {done:,}/{self.total:,} tokens, {rate:,.0f} tokens/s, {left:.0f}s left"
        if self.tty:
            print("\r" + line + "\033[K", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)
        self.shown = True

    def close(self) -> None:
        if self.tty and self.shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def run(args) -> int:
    check_args(args)
    model, meta = checkpoint_model(args.ckpt)
    dataset = checkpoint_vocabulary(meta, args.ckpt)
    prompt, context = choose_prompt(args.prompt, dataset, args.seed)
    addition = dataset.name == "addition"
    n = args.tokens or (dataset.seq_len - dataset.prompt_len if addition else 200)
    ids = dataset.encode(context)[None, :]
    new = array("q")  # 8 bytes a token: an absurd --tokens only takes time
    progress = Progress(n)
    try:
        for nxt in generate_tokens(model, ids, n, args.temperature, numpy.random.default_rng(args.seed)):
            new.append(int(nxt[0]))
            progress.update(len(new))
    except KeyboardInterrupt:
        progress.close()
        print(prompt + dataset.decode(new), flush=True)
        raise KeyboardInterrupt(
            f"stopped after {len(new):,} of {n:,} tokens; the text above is what was generated"
        ) from None
    progress.close()
    text = dataset.decode(new)
    whole_problem = addition and len(prompt) == dataset.prompt_len and prompt.endswith("=")
    if whole_problem and text.isdigit():  # the answer is written least-significant digit first
        print(f"{prompt}{text}   (the model's sum: {int(text[::-1])})")
    else:
        print(prompt + text)
    return 0
