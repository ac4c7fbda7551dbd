"""Token-weighted loss normalisation (train/step.py) at every engine and layout, for real: on a task whose rows hold
different numbers of labelled tokens (running sums mod m, rows of 4 to 32 positions right-padded with -100), one
process accumulating 4 micro-batches, DDP, ZeRO-3, DeepSpeed, the pipeline and context parallel (each rank holding its
piece of every sequence, the right-padded second halves with fewer labels) take the same global batch as one process
taking it whole in one micro-batch, and log the same losses and produce the same step-1 gradients. A mean of
per-micro-batch (or per-rank) means would not."""

from __future__ import annotations

import pytest

from hybridtron.cli import main

from .test_data_parallel import assert_same_grads, assert_same_steps, dump_grads, ranks, steps

pytestmark = pytest.mark.slow

ARGS = ["--config", "tiny", "--data.synthetic.task", "modadd", "--data.seq_len", "32",
        "--data.synthetic.min_length", "4", "--data.synthetic.train_rows", "200", "--model.d_model", "32",
        "--model.n_layers", "2", "--model.n_heads", "2", "--model.n_kv_heads", "1", "--model.max_seq_len", "64",
        "--train.max_steps", "2", "--train.warmup_steps", "1", "--train.eval_every", "0", "--checkpoint.every", "0",
        "--checkpoint.at_exit", "false", "--train.micro_batch_size", "2", *dump_grads()]
LAYOUTS = {  # name: (processes, arguments); each takes the 8 rows per step the reference takes in one micro-batch
    "accum4": (1, ["--train.grad_accum_steps", "4"]),
    "ddp": (2, ["--parallel.zero_stage", "0", "--train.grad_accum_steps", "2"]),
    "zero3": (2, ["--parallel.zero_stage", "3", "--train.grad_accum_steps", "2"]),
    "deepspeed": (2, ["--parallel.engine", "deepspeed", "--parallel.zero_stage", "1", "--train.grad_accum_steps", "2"]),
    "pp2": (2, ["--parallel.pp", "2", "--train.grad_accum_steps", "4"]),
    "cp2": (2, ["--parallel.cp", "2", "--train.grad_accum_steps", "4"]),
}


def _argv(data, run, extra):
    return ["train", "--run-dir", str(run), "--data.out_dir", str(data), *ARGS, *extra]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss_layouts")
    assert main(_argv(root / "data", root / "single", ["--train.micro_batch_size", "8"])) == 0
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_uneven_labels_train_alike_at_every_layout(layout, single):
    nproc, extra = LAYOUTS[layout]
    run = single / layout
    if nproc == 1:
        assert main(_argv(single / "data", run, extra)) == 0
    else:
        res = ranks(_argv(single / "data", run, extra), nproc=nproc)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert_same_steps(steps(run), steps(single / "single"))
    assert_same_grads(run, single / "single")
