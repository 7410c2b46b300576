"""A checkpoint is self-contained (issue 26): ``tinytrain sample`` needs no training text (moved,
edited or deleted), ``--resume`` names what changed (the text's characters, a setting that shapes
the run's curve) in one sentence, an empty or foreign prompt is handled, and generation with a
key/value cache gives what the uncached generation gives, past the block size too; Ctrl-C prints
the text so far. Serial and in-process where possible; tiny models."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy
import pytest

from grader.run import mpi_environment  # a subprocess must not think it is this rank
from tinytrain import checkpoint
from tinytrain.backend import to_host
from tinytrain.cli import main
from tinytrain.data import AdditionDataset
from tinytrain.nn import GPT, GPTConfig
from tinytrain.sample import generate

TINY = "--layers 1 --width 32 --heads 2 --batch-size 4 --eval-every 100 --eval-batches 1 --no-plot --quiet".split()
WORDS = ["the ", "cat ", "sat ", "on ", "a ", "mat. ", "\n"]


def write_text(path, seed=0, extra=""):
    rng = numpy.random.default_rng(seed)
    path.write_text("".join(rng.choice(WORDS, size=300)) + extra, encoding="utf-8")
    return path


def train(out, *extra):
    assert main(["train", *TINY, "--out", str(out), *extra]) == 0


def train_text(tmp_path, *extra):
    """A 2-step run on a text file: (the text's path, the checkpoint folder)."""
    text = write_text(tmp_path / "book.txt")
    train(tmp_path / "run", "--data", str(text), "--block-size", "8", "--steps", "2", *extra)
    return text, tmp_path / "run" / "ckpt"


def sample(capsys, ckpt, *extra) -> str:
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(ckpt), *extra]) == 0
    return capsys.readouterr().out


def refused(capsys, argv) -> str:
    """The one sentence (exit 2) that ``argv`` is refused with."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def forget_vocabulary(ckpt) -> None:
    """Make ``ckpt`` look like one written before checkpoints kept their vocabulary."""
    path = ckpt / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["dataset"]
    path.write_text(json.dumps(manifest))


# --- sample needs no training text ----------------------------------------------------------------


def test_the_checkpoint_keeps_the_vocabulary_and_the_default_prompt(tmp_path):
    text, ckpt = train_text(tmp_path)
    kept = checkpoint.Reader(ckpt).meta["dataset"]
    content = text.read_text(encoding="utf-8")
    assert kept["name"] == "text" and kept["chars"] == "".join(sorted(set(content)))
    assert kept["prompt"] == content[int(0.9 * len(content))]  # the validation text's first character
    train(tmp_path / "sums", "--steps", "1")
    assert checkpoint.Reader(tmp_path / "sums" / "ckpt").meta["dataset"]["digits"] == 2


@pytest.mark.parametrize("change", ["moved", "deleted", "edited"])
def test_sample_gives_the_same_text_after_the_training_text_changed(tmp_path, capsys, change):
    text, ckpt = train_text(tmp_path)
    before = [sample(capsys, ckpt, "--tokens", "12"), sample(capsys, ckpt, "--prompt", "the ", "--tokens", "12")]
    if change == "moved":
        text.rename(tmp_path / "elsewhere.txt")
    elif change == "deleted":
        text.unlink()
    else:  # other characters: rebuilt from it, the vocabulary would map tokens to other characters
        write_text(text, seed=1, extra="Zürich é")
    after = [sample(capsys, ckpt, "--tokens", "12"), sample(capsys, ckpt, "--prompt", "the ", "--tokens", "12")]
    assert after == before


def test_an_older_checkpoint_rebuilds_its_vocabulary_from_the_text_or_says_why_not(tmp_path, capsys):
    text, ckpt = train_text(tmp_path)
    before = sample(capsys, ckpt, "--prompt", "the ", "--tokens", "12")
    forget_vocabulary(ckpt)
    assert sample(capsys, ckpt, "--prompt", "the ", "--tokens", "12") == before  # the text is still there
    write_text(text, extra="é")
    err = refused(capsys, ["sample", "--ckpt", str(ckpt)])
    assert f"the training text {text} has changed since" in err and "put the text it was trained on back" in err
    text.unlink()
    err = refused(capsys, ["sample", "--ckpt", str(ckpt)])
    assert f"needs its training text {text}, which is not there" in err and "--data" not in err


# --- resume names what changed --------------------------------------------------------------------


def test_resume_with_other_characters_names_them(tmp_path, capsys):
    text, ckpt = train_text(tmp_path)
    content = text.read_text(encoding="utf-8")
    text.write_text(content.replace("m", "é").replace("c", "ü"), encoding="utf-8")  # as many characters
    err = refused(
        capsys,
        ["train", *TINY, "--out", str(tmp_path / "run"), "--data", str(text), "--block-size", "8"]
        + ["--steps", "2", "--resume"],
    )
    assert f"the text in --data {text} has other characters than the checkpoint's (2 new: 'é', 'ü'; 2 gone: " in err
    assert "'c', 'm'); resume with the text it was trained on" in err
    assert "vocab" not in err


def test_resume_of_an_older_checkpoint_with_more_characters_says_so(tmp_path, capsys):
    text, ckpt = train_text(tmp_path)
    forget_vocabulary(ckpt)
    n = len(set(text.read_text(encoding="utf-8")))
    write_text(text, extra="éü")
    err = refused(
        capsys,
        ["train", *TINY, "--out", str(tmp_path / "run"), "--data", str(text), "--block-size", "8"]
        + ["--steps", "2", "--resume"],
    )
    assert f"the text in --data {text} has {n + 2} different characters, the checkpoint's {n}; resume with" in err
    assert "--data 18" not in err and "vocab" not in err


def test_resume_after_the_text_moved_or_changed_within_its_characters_goes_on(tmp_path, capsys):
    text, ckpt = train_text(tmp_path, "--warmup", "0", "--min-lr", "1e-3")
    moved = text.rename(tmp_path / "moved.txt")
    common = [*TINY, "--out", str(tmp_path / "run"), "--block-size", "8", "--warmup", "0", "--min-lr", "1e-3"]
    capsys.readouterr()
    assert main(["train", *common, "--data", str(moved), "--steps", "3", "--resume"]) == 0
    assert "note" not in capsys.readouterr().err  # the same text, moved: nothing to say
    write_text(moved, seed=2)  # other text, the same characters
    assert main(["train", *common, "--data", str(moved), "--steps", "4", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"note: the text in --data {moved} is not the one the checkpoint was trained on" in err
    assert checkpoint.Reader(ckpt).meta["step"] == 4


@pytest.mark.parametrize(
    "flag,value,says",
    [
        ("--steps", "6", "--steps 4 (its learning-rate schedule follows it); resume with --steps 4"),
        ("--batch-size", "8", "--batch-size 4 (every step's batch follows it); resume with --batch-size 4"),
        ("--lr", "0.002", "--lr 0.001 (the learning rate follows it); resume with --lr 0.001"),
        ("--min-lr", "0", "--min-lr 0.0001 (the learning rate follows it); resume with --min-lr 0.0001"),
        ("--warmup", "2", "--warmup 1 (the learning rate follows it); resume with --warmup 1"),
        ("--weight-decay", "0.1", "--weight-decay 0.01 (every update follows it); resume with --weight-decay 0.01"),
        ("--grad-clip", "0", "--grad-clip 1 (every update follows it); resume with --grad-clip 1"),
        ("--dropout", "0.1", "--dropout 0 (the dropout masks follow it); resume with --dropout 0"),
    ],
    ids=lambda v: v if v.startswith("--") and " " not in v else "",
)
def test_resume_with_a_setting_that_shapes_the_run_is_refused_by_flag(tmp_path, monkeypatch, capsys, flag, value, says):
    out, common = tmp_path / "run", ["--steps", "4", "--warmup", "1", "--ckpt-every", "2"]
    real_batch = AdditionDataset.batch

    def dies_at_step_3(self, split, batch_size, seed, step):
        if split == "train" and step == 3:
            raise KeyboardInterrupt("simulated crash at step 3")
        return real_batch(self, split, batch_size, seed, step)

    monkeypatch.setattr(AdditionDataset, "batch", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(out, *common)
    monkeypatch.undo()
    assert checkpoint.Reader(out / "ckpt").meta["step"] == 2
    err = refused(capsys, ["train", *TINY, "--out", str(out), *common, flag, value, "--resume"])
    assert err == f"tinytrain train: error: the checkpoint in {out / 'ckpt'} was trained with {says}\n"
    train(out, *common, "--resume")  # with the checkpoint's settings it goes on
    assert checkpoint.Reader(out / "ckpt").meta["step"] == 4


def test_resume_may_extend_a_constant_rate_and_change_what_does_not_shape_the_run(tmp_path):
    out = tmp_path / "run"
    constant = ["--warmup", "0", "--min-lr", "1e-3"]
    train(out, "--steps", "2", *constant)
    train(out, "--steps", "3", *constant, "--resume", "--eval-every", "1", "--eval-batches", "2", "--ckpt-every", "5")
    assert checkpoint.Reader(out / "ckpt").meta["step"] == 3


# --- sample's prompt ------------------------------------------------------------------------------


def test_an_empty_prompt_starts_after_a_newline(tmp_path, capsys):
    _, ckpt = train_text(tmp_path)
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(ckpt), "--prompt", "", "--tokens", "10"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out) == 10 + 1  # the ten new characters, then print's newline
    assert "the prompt is empty: generating after a newline (not printed)" in captured.err
    assert sample(capsys, ckpt, "--prompt", "\n", "--tokens", "10") == "\n" + captured.out  # the same start


def test_an_empty_prompt_for_the_addition_task_is_one_sentence(tmp_path, capsys):
    train(tmp_path, "--steps", "1")
    err = refused(capsys, ["sample", "--ckpt", str(tmp_path / "ckpt"), "--prompt", ""])
    assert "--prompt is empty, but the addition task continues the start of a problem" in err


def test_a_prompt_character_outside_the_vocabulary_is_named(tmp_path, capsys):
    _, ckpt = train_text(tmp_path)
    err = refused(capsys, ["sample", "--ckpt", str(ckpt), "--prompt", "the é"])
    assert "--prompt has 'é', a character the model was not trained on" in err and "leave it out" in err


def test_a_short_sample_shows_no_progress(tmp_path, capsys):
    _, ckpt = train_text(tmp_path)
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(ckpt), "--tokens", "20"]) == 0
    assert capsys.readouterr().err == ""


# --- the key/value cache --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [{}, {"n_experts": 3, "moe_top_k": 2}, {"n_experts": 3, "moe_top_k": 1, "moe_capacity_factor": 1.0}],
    ids=["plain", "moe", "moe-capacity"],
)
@pytest.mark.parametrize("prompt_len", [1, 5, 12], ids=["prompt-1", "prompt-5", "prompt-past-block"])
def test_the_cache_generates_what_the_uncached_generation_does(extra, prompt_len):
    """Greedy, 3 rows, 30 tokens with block size 8: the cached path up to the block, the sliding window after."""
    # an untied head: a tied one at initialization mostly repeats the last token, whatever the context
    config = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_weights=False, **extra)
    model = GPT(config, seed=4)
    ids = numpy.random.default_rng(prompt_len).integers(0, 13, size=(3, prompt_len))
    uncached = generate(model, ids, 30, cache=False)
    whole_context, forward = [], model.forward
    model.forward = lambda ids: whole_context.append(ids.shape[1]) or forward(ids)
    cached = generate(model, ids, 30)
    assert cached.shape == (3, 30) and len(numpy.unique(uncached)) > 2  # not a constant
    numpy.testing.assert_array_equal(cached, uncached)
    assert model.training  # the caller's mode comes back
    # the whole context is rerun only once the window slides; with a capacity, for every token
    if "moe_capacity_factor" in extra:
        assert whole_context == [min(prompt_len + i, 8) for i in range(30)]
    else:  # the cache takes the prompt and the tokens until the block is full
        assert whole_context == [8] * (30 - max(1, 9 - prompt_len))


def test_decode_gives_the_forward_logits_one_position_at_a_time():
    model = GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16), seed=5)
    model.eval()
    ids = numpy.arange(8)[None, :] % 13
    full = to_host(model(ids).data)
    cache = model.kv_cache(1)
    first = to_host(model.decode(ids[:, :3], cache).data)  # the prompt at once
    rest = [to_host(model.decode(ids[:, t : t + 1], cache).data) for t in range(3, 8)]
    numpy.testing.assert_allclose(numpy.concatenate([first, *rest], axis=1), full, rtol=1e-5, atol=1e-6)
    assert cache.length == 8
    with pytest.raises(ValueError, match="exceed block_size=8"):
        model.decode(ids[:, :1], cache)


# --- Ctrl-C ---------------------------------------------------------------------------------------


def test_ctrl_c_prints_the_text_so_far_and_exits_130(tmp_path):
    """A run far too long to wait for (its progress shows on stderr), interrupted once it has."""
    _, ckpt = train_text(tmp_path)
    argv = [sys.executable, "-m", "tinytrain.cli", "sample", "--ckpt", str(ckpt), "--prompt", "the ", "--tokens"]
    env = dict(mpi_environment(), TINYTRAIN_DEVICE="cpu")
    env.pop("TINYTRAIN_DEBUG", None)  # the test harness turns it on; the program runs as a user's
    proc = subprocess.Popen([*argv, "10000000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        progress = proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # if it did not stop
    assert proc.returncode == 130, progress + err
    assert progress.startswith("tinytrain sample: ") and "/10,000,000 tokens" in progress, progress
    assert out.startswith("the ") and len(out) > len("the ") + 10
    last = err.strip().splitlines()[-1]
    assert last.startswith("tinytrain sample: interrupted: stopped after ") and "of 10,000,000 tokens" in last, err
    assert "Traceback" not in err and err.count("interrupted") == 1, err
