"""Datasets: the addition task, character text, sharding a global batch over ranks."""

from __future__ import annotations

import numpy
import pytest

from tinytrain.data import IGNORE, AdditionDataset, CharDataset, load_dataset, shard_rows


def check_rows(ds, x, y):
    """Every row is a correct sum with a reversed answer; prompt targets are IGNORE."""
    d = ds.digits
    for xr, yr in zip(x, y):
        seq = numpy.concatenate([xr, yr[-1:]])
        numpy.testing.assert_array_equal(xr[1:], numpy.where(yr[:-1] == IGNORE, xr[1:], yr[:-1]))
        text = ds.decode(seq)
        a, rest = text.split("+")
        b, answer = rest.split("=")
        assert len(a) == d and len(b) == d and len(answer) == d + 1
        assert int(answer[::-1]) == int(a) + int(b), text
        assert (yr[: ds.prompt_len - 1] == IGNORE).all()
        assert (yr[ds.prompt_len - 1 :] != IGNORE).all()
        numpy.testing.assert_array_equal(yr[ds.prompt_len - 1 :], ds.encode(answer))


@pytest.mark.parametrize("digits", [1, 3, 4])
def test_addition_rows_are_correct_sums(digits):
    ds = AdditionDataset(digits)
    assert ds.block_size == ds.seq_len - 1 == 3 * digits + 2
    step = int(numpy.random.default_rng().integers(1000))
    for split in ("train", "val"):
        x, y = ds.batch(split, 16, seed=0, step=step)
        assert x.shape == y.shape == (16, ds.block_size)
        assert x.dtype == numpy.int64
        check_rows(ds, x, y)


def test_addition_batches_are_a_function_of_seed_and_step():
    ds = AdditionDataset()
    seed, step = (int(v) for v in numpy.random.default_rng().integers(0, 10_000, size=2))
    a = ds.batch("train", 32, seed, step)
    b = ds.batch("train", 32, seed, step)
    numpy.testing.assert_array_equal(a[0], b[0])
    numpy.testing.assert_array_equal(a[1], b[1])
    assert not numpy.array_equal(a[0], ds.batch("train", 32, seed, step + 1)[0])
    assert not numpy.array_equal(a[0], ds.batch("train", 32, seed + 1, step)[0])
    assert not numpy.array_equal(a[0], ds.batch("val", 32, seed, step)[0])


def test_addition_train_and_val_are_disjoint():
    ds = AdditionDataset(2)  # 10,000 problems, so both splits repeat and overlap would show

    def problems(split):
        out = set()
        for step in range(20):
            x, _ = ds.batch(split, 64, seed=3, step=step)
            out.update(ds.decode(r[: ds.prompt_len]) for r in x)
        return out

    train, val = problems("train"), problems("val")
    assert len(train) > 500 and len(val) > 200
    assert not (train & val)
    # about 10% of all problems are validation ones
    a, b = numpy.meshgrid(numpy.arange(100), numpy.arange(100))
    share = ds._is_val(a.ravel(), b.ravel()).mean()
    assert 0.05 < share < 0.15


def test_addition_accuracy_counts_exact_answers():
    ds = AdditionDataset(2)

    def oracle(prompts, n):
        out = []
        for p in prompts:
            a, b = ds.decode(p[:-1]).split("+")
            out.append(ds.encode(str(int(a) + int(b)).zfill(n)[::-1]))
        return numpy.stack(out)

    assert ds.accuracy(oracle, count=50) == 1.0
    assert ds.accuracy(lambda p, n: numpy.zeros((len(p), n), dtype=int), count=50) < 0.1


def test_addition_rejects_bad_digits():
    for d in (0, 7):
        with pytest.raises(ValueError, match="digits"):
            AdditionDataset(d)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_shard_rows_concatenate_to_the_global_batch(world):
    ds = AdditionDataset()
    x, y = ds.batch("train", 16, seed=1, step=int(numpy.random.default_rng().integers(100)))
    xs = [shard_rows(x, r, world) for r in range(world)]
    assert all(s.shape == (16 // world, x.shape[1]) for s in xs)
    numpy.testing.assert_array_equal(numpy.concatenate(xs), x)
    numpy.testing.assert_array_equal(numpy.concatenate([shard_rows(y, r, world) for r in range(world)]), y)


def test_shard_rows_indivisible_is_an_error():
    with pytest.raises(ValueError, match="multiple of 3"):
        shard_rows(numpy.zeros((10, 2)), 0, 3)


def write_text(tmp_path, n):
    rng = numpy.random.default_rng()
    text = "".join(rng.choice(list("abcde \n"), size=n))
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    return path, text


def test_char_dataset(tmp_path):
    path, text = write_text(tmp_path, 2000)
    ds = CharDataset(str(path), block_size=16)
    assert ds.chars == "".join(sorted(set(text))) and ds.vocab_size == len(ds.chars)
    assert ds.decode(ds.encode(text)) == text
    x, y = ds.batch("train", 5, seed=0, step=3)
    assert x.shape == y.shape == (5, 16)
    numpy.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    whole = ds.encode(text)
    cut = int(0.9 * len(whole))
    train = whole[:cut]
    for row_x, row_y in zip(x, y):  # every row is a contiguous piece of the training text
        seq = numpy.concatenate([row_x, row_y[-1:]])
        hits = [s for s in range(len(train) - 16) if numpy.array_equal(train[s : s + 17], seq)]
        assert hits
    numpy.testing.assert_array_equal(x, ds.batch("train", 5, seed=0, step=3)[0])
    assert not numpy.array_equal(x, ds.batch("train", 5, seed=0, step=4)[0])
    xv, _ = ds.batch("val", 5, seed=0, step=3)
    assert xv.shape == (5, 16)
    with pytest.raises(ValueError, match="vocabulary"):
        ds.encode("xyz")


def test_char_dataset_too_short(tmp_path):
    path, _ = write_text(tmp_path, 100)
    with pytest.raises(ValueError, match="block.size"):
        CharDataset(str(path), block_size=16)


def test_load_dataset(tmp_path):
    assert isinstance(load_dataset(None), AdditionDataset)
    assert isinstance(load_dataset("addition"), AdditionDataset)
    path, _ = write_text(tmp_path, 1000)
    ds = load_dataset(str(path), 8)
    assert isinstance(ds, CharDataset) and ds.block_size == 8
    with pytest.raises(ValueError, match="neither"):
        load_dataset(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError):
        load_dataset(str(tmp_path))  # a folder is not a text file


def test_char_dataset_smallest_allowed_file_batches_both_splits(tmp_path):
    """A file of exactly 10·(block+1) characters passes the length check, so both splits must
    batch: validation then holds exactly one window (it used to crash: high <= 0)."""
    block = 16
    rng = numpy.random.default_rng()
    text = "".join(rng.choice(list("abcdefgh"), size=10 * (block + 1)))
    path = tmp_path / "min.txt"
    path.write_text(text, encoding="utf-8")
    ds = CharDataset(str(path), block_size=block)
    val = ds.splits["val"]
    assert len(val) == block + 1
    x, y = ds.batch("val", 3, seed=0, step=0)
    for row_x, row_y in zip(x, y):  # the only window there is
        numpy.testing.assert_array_equal(row_x, val[:block])
        numpy.testing.assert_array_equal(row_y, val[1:])
    # the last window of the training split is reachable too
    train = ds.splits["train"]
    last = len(train) - block - 1
    for step in range(200):
        xs, _ = ds.batch("train", 64, seed=1, step=step)
        if any(numpy.array_equal(r, train[last : last + block]) for r in xs):
            break
    else:
        pytest.fail("the last training window was never drawn")
