"""Datasets: a built-in addition task (generated in code, no download) and character-level text.

Batches are a pure function of ``(seed, step)``: ``dataset.batch(split, batch_size, seed, step)``
draws the *global* batch, and a data-parallel rank takes its rows with ``shard_rows``. So N ranks
with batch B each see exactly what one process with batch N·B sees, and a resumed run continues
with exactly the batches it would have drawn.

The addition task (3 digits shown; the default is 2): ``"347+085=2340"`` is 347 + 85 = 432 with
the answer written *reversed* (least significant digit first, as a person adds), a classic
small-transformer task with an exact-match accuracy. The loss is taken on the answer digits only
(the prompt's targets are set to ``IGNORE``), so the loss and the accuracy measure the same thing.

A checkpoint keeps what the model needs of its data (``dataset.describe()``: for text, its
characters, a fingerprint of the text and the default prompt; for addition, ``digits``), so
``tinytrain sample`` needs no training text, and ``--resume`` can say what changed in it
(:func:`dataset_change`). :func:`from_description` turns that back into an encoder/decoder.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy

IGNORE = -100  # target value that cross_entropy leaves out


def shard_rows(batch, rank: int, world: int):
    """Rows ``[rank·B/N, (rank+1)·B/N)`` of a global batch (its first axis must divide by N)."""
    n = batch.shape[0]
    if n % world:
        raise ValueError(f"global batch of {n} rows does not split over {world} ranks; choose a multiple of {world}")
    per = n // world
    return batch[rank * per : (rank + 1) * per]


def replica_batch(x, y, rank: int, world: int):
    """This data-parallel replica's rows of the global batch ``(x, y)``, and the number of counted
    targets in the *whole* global batch: a replica that divides its summed loss by that number
    gets a loss (and gradients) that add up over replicas to exactly the serial mean."""
    return shard_rows(x, rank, world), shard_rows(y, rank, world), int((y != IGNORE).sum())


class AdditionDataset:
    """Sums of two ``digits``-digit numbers; 10% of all problems are held out for validation."""

    name = "addition"

    def __init__(self, digits: int = 3):
        if not 1 <= digits <= 6:
            raise ValueError(f"digits must be between 1 and 6, got {digits}")
        self.digits = digits
        self.chars = "0123456789+="
        self.vocab_size = len(self.chars)
        self.prompt_len = 2 * digits + 2  # "aaa+bbb="
        self.seq_len = self.prompt_len + digits + 1  # answer has digits+1 digits
        self.block_size = self.seq_len - 1

    def encode(self, text: str):
        unknown = sorted(set(text) - set(self.chars))
        if unknown:
            raise ValueError(
                f"the addition task has only the characters {self.chars!r}; {''.join(unknown)!r} are not among them "
                "(give a prompt such as '12+34=')"
            )
        return numpy.array([self.chars.index(c) for c in text], dtype=numpy.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def describe(self) -> dict:
        """What a checkpoint keeps of this dataset: its settings suffice to rebuild it."""
        return {"name": self.name, "digits": self.digits, "chars": self.chars}

    def _is_val(self, a, b):
        # A fixed hash of the problem decides its split, so train and validation never overlap.
        h = (a * 1_000_003 + b * 7919 + 12345) * 2654435761 % (2**32)
        return (h % 10) == 0

    def problems(self, split: str, count: int, rng):
        """``count`` (a, b) pairs from ``split``, drawn with ``rng``."""
        top = 10**self.digits
        out_a, out_b, have = [], [], 0
        while have < count:
            a = rng.integers(0, top, size=2 * count)
            b = rng.integers(0, top, size=2 * count)
            keep = self._is_val(a, b) == (split == "val")
            out_a.append(a[keep])
            out_b.append(b[keep])
            have += int(keep.sum())
        return numpy.concatenate(out_a)[:count], numpy.concatenate(out_b)[:count]

    def render(self, a, b):
        """Token ids (count, seq_len) of the problems ``a + b`` with reversed answers: the ids of
        the text ``f"{a:0{d}d}+{b:0{d}d}="`` and the sum's d+1 digits, lowest first. Written with
        array arithmetic (a digit's id is the digit itself): every rank of a data-parallel run
        renders the whole global batch each step, and a Python loop over the rows cost 0.6 ms of
        a 25 ms step."""
        d = self.digits
        a, b = numpy.asarray(a, dtype=numpy.int64), numpy.asarray(b, dtype=numpy.int64)
        high_first = 10 ** numpy.arange(d - 1, -1, -1, dtype=numpy.int64)
        low_first = 10 ** numpy.arange(d + 1, dtype=numpy.int64)
        rows = numpy.empty((a.size, self.seq_len), dtype=numpy.int64)
        rows[:, :d] = a[:, None] // high_first % 10
        rows[:, d] = self.chars.index("+")
        rows[:, d + 1 : 2 * d + 1] = b[:, None] // high_first % 10
        rows[:, 2 * d + 1] = self.chars.index("=")
        rows[:, 2 * d + 2 :] = (a + b)[:, None] // low_first % 10
        return rows

    def batch(self, split: str, batch_size: int, seed: int, step: int):
        """Inputs and targets (batch_size, block_size); prompt targets are IGNORE."""
        rng = numpy.random.default_rng([seed, step, 0 if split == "train" else 1])
        seqs = self.render(*self.problems(split, batch_size, rng))
        x, y = seqs[:, :-1], seqs[:, 1:].copy()
        y[:, : self.prompt_len - 1] = IGNORE
        return x, y

    def examples(self, limit: int = 1 << 16, seed: int = 0):
        """The training problems as a finite pool (federated clients split it): ``(keys, labels)``,
        a key ``a·10^d + b`` per problem and its label, the answer's lowest digit (the first answer
        token). Every training problem while there are at most ``limit`` (two digits: 9,000 or so),
        else ``limit`` distinct ones drawn with ``seed``."""
        top = 10**self.digits
        if top * top <= limit:
            keys = numpy.arange(top * top, dtype=numpy.int64)
        else:
            keys = numpy.unique(numpy.random.default_rng([seed, 3]).integers(0, top * top, size=limit))
        keys = keys[~self._is_val(keys // top, keys % top)]
        return keys, (keys // top + keys % top) % 10

    def rows(self, keys):
        """Inputs and targets of the problems ``keys`` (of :meth:`examples`), as ``batch`` gives them."""
        top = 10**self.digits
        seqs = self.render(keys // top, keys % top)
        x, y = seqs[:, :-1], seqs[:, 1:].copy()
        y[:, : self.prompt_len - 1] = IGNORE
        return x, y

    def accuracy(self, generate, split="val", count=200, seed=0) -> float:
        """Share of ``count`` problems whose whole answer ``generate(prompts, n)`` gets right."""
        rng = numpy.random.default_rng([seed, 2**31 - 1])
        seqs = self.render(*self.problems(split, count, rng))
        prompts, answers = seqs[:, : self.prompt_len], seqs[:, self.prompt_len :]
        produced = generate(prompts, answers.shape[1])
        return float((produced == answers).all(axis=1).mean())


class CharVocabulary:
    """The characters of a text, sorted: token ``i`` is ``chars[i]``. What a checkpoint keeps of its
    text (``CharDataset.describe``), enough to encode a prompt and decode what the model writes.

    ``prompt``: the default prompt (the validation split's first character); ``start``: the text's
    first character."""

    name = "text"

    def __init__(self, chars: str, prompt: str | None = None, start: str | None = None):
        self.chars = chars
        self.vocab_size = len(chars)
        self._index = {c: i for i, c in enumerate(chars)}
        self.prompt = prompt if prompt is not None else chars[:1]
        self.start = start if start is not None else chars[:1]

    def unknown(self, text: str) -> list[str]:
        """The characters of ``text`` outside this vocabulary, in order of first appearance."""
        return list(dict.fromkeys(c for c in text if c not in self._index))

    def encode(self, text: str):
        unknown = self.unknown(text)
        if unknown:
            raise ValueError(
                f"{char_listing(unknown)} {'is' if len(unknown) == 1 else 'are'} not in the vocabulary "
                f"(the {self.vocab_size} characters of the text the model was trained on)"
            )
        return numpy.array([self._index[c] for c in text], dtype=numpy.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CharDataset(CharVocabulary):
    """Character-level text from a file: 90% for training, the last 10% for validation."""

    def __init__(self, path: str, block_size: int = 64):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"--data {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); give a text file"
            ) from None
        if len(text) < 10 * (block_size + 1):
            raise ValueError(
                f"{path} has {len(text)} characters; with block size {block_size} it needs at "
                f"least {10 * (block_size + 1)} (give a longer file or a smaller --block-size)"
            )
        cut = int(0.9 * len(text))
        super().__init__("".join(sorted(set(text))), prompt=text[cut], start=text[0])
        self.path = str(path)
        self.block_size = block_size
        self.length = len(text)
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        ids = self.encode(text)
        self.splits = {"train": ids[:cut], "val": ids[cut:]}

    def describe(self) -> dict:
        """What a checkpoint keeps of this text: its characters, its fingerprint, the default prompt."""
        return {
            "name": self.name,
            "chars": self.chars,
            "characters": self.length,
            "sha256": self.sha256,
            "prompt": self.prompt,
            "start": self.start,
        }

    def batch(self, split: str, batch_size: int, seed: int, step: int):
        data = self.splits[split]
        rng = numpy.random.default_rng([seed, step, 0 if split == "train" else 1])
        starts = rng.integers(0, len(data) - self.block_size, size=batch_size)  # last start: len - block - 1
        x = numpy.stack([data[s : s + self.block_size] for s in starts])
        y = numpy.stack([data[s + 1 : s + self.block_size + 1] for s in starts])
        return x, y

    def examples(self, limit: int = 1 << 20, seed: int = 0):
        """The training windows as a finite pool (federated clients split it): ``(keys, labels)``,
        a window's start position and its first character. Every start while there are at most
        ``limit``, else every k-th, so that ``limit`` remain."""
        starts = len(self.splits["train"]) - self.block_size
        keys = numpy.arange(0, starts, max(1, -(-starts // limit)), dtype=numpy.int64)
        return keys, self.splits["train"][keys]

    def rows(self, keys):
        """Inputs and targets of the windows starting at ``keys`` (of :meth:`examples`)."""
        data = self.splits["train"]
        x = (
            numpy.stack([data[s : s + self.block_size] for s in keys])
            if len(keys)
            else numpy.zeros((0, self.block_size), numpy.int64)
        )
        y = numpy.stack([data[s + 1 : s + self.block_size + 1] for s in keys]) if len(keys) else x.copy()
        return x, y


def load_dataset(data: str | None, block_size: int | None = None, digits: int = 2):
    """``None`` or "addition" -> the addition task; a path -> characters of that file."""
    if data in (None, "addition"):
        return AdditionDataset(digits)
    if not Path(data).is_file():
        raise ValueError(f"--data {data!r} is neither 'addition' nor a readable text file")
    return CharDataset(data, block_size or 64)


def from_description(description: dict):
    """The encoder/decoder a checkpoint's ``dataset`` entry describes (``describe()``): the addition
    task, or a ``CharVocabulary`` (no text needed)."""
    if description["name"] == "addition":
        return AdditionDataset(description["digits"])
    return CharVocabulary(description["chars"], description.get("prompt"), description.get("start"))


def dataset_change(saved: dict | None, current: dict | None, data: str) -> tuple[str | None, str | None]:
    """How the data of a resumed run differs from a checkpoint's: ``(refusal, note)``, each one
    sentence or None. Other characters are a refusal (the model's tokens would mean other
    characters); the same characters in another text are a note (the run goes on, on the new
    text); a moved file with the same text is neither. ``saved`` None: an older checkpoint."""
    if not saved or not current or saved["name"] != "text" or current["name"] != "text":
        return None, None  # the addition task, or a change of task: model_mismatch names --data
    if saved["chars"] != current["chars"]:
        new = [c for c in current["chars"] if c not in saved["chars"]]
        gone = [c for c in saved["chars"] if c not in current["chars"]]
        parts = [f"{len(new)} new: {char_listing(new)}"] if new else []
        parts += [f"{len(gone)} gone: {char_listing(gone)}"] if gone else []
        return (
            f"the text in --data {data} has other characters than the checkpoint's ({'; '.join(parts)}); "
            "resume with the text it was trained on"
        ), None
    if saved.get("sha256", current["sha256"]) != current["sha256"]:
        return None, (
            f"the text in --data {data} is not the one the checkpoint was trained on (the same "
            f"{len(current['chars'])} characters, {current['characters']:,} of them instead of "
            f"{saved['characters']:,}): the resumed run draws its batches from the new text"
        )
    return None, None


def char_listing(chars, most: int = 5) -> str:
    """``'é', '\\n', 'x'`` (and how many more)."""
    shown = ", ".join(repr(c) for c in chars[:most])
    return shown + (f" and {len(chars) - most} more" if len(chars) > most else "")
