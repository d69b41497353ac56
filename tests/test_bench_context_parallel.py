"""benchmarks/context_parallel.py without GPUs: its arguments, its cases (issue 28's weak and
strong scaling) and their FLOP counts, `--help` and `--dry-run`. The timed runs need torchrun on
a machine with several GPUs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import context_parallel as bench  # noqa: E402
from harness import attention_flops  # noqa: E402


def test_defaults_are_the_issues_cases():
    args = bench.parse_args([])
    assert (args.dtype, args.head_dim, args.causal, args.layout) == ("bfloat16", 128, True,
                                                                     "zigzag")
    cases = bench.build_cases(args, 8)
    weak = sorted({c.local for c in cases if c.mode == "weak"})
    strong = sorted({c.seq for c in cases if c.mode == "strong"})
    assert weak == [16384, 65536]
    assert strong == [131072, 262144, 1048576]
    assert {c.direction for c in cases} == {"fwd", "step"}
    assert len(cases) == 2 * (2 + 3)
    assert all(c.world == 8 and c.local * 8 == c.seq for c in cases)


def test_a_sequence_that_does_not_split_is_left_out():
    args = bench.parse_args(["--mode", "strong", "--seq", "96,100", "--direction", "fwd"])
    assert [c.seq for c in bench.build_cases(args, 3)] == [96]  # 100 is not 6 chunks
    args = bench.parse_args(["--mode", "strong", "--seq", "96,100", "--direction", "fwd",
                             "--layout", "contiguous"])
    assert [c.seq for c in bench.build_cases(args, 4)] == [96, 100]


def test_flops_per_gpu_are_the_unsharded_calls_over_the_world():
    args = bench.parse_args(["--mode", "weak", "--tokens-per-gpu", "1024", "--direction",
                             "step", "--heads", "8", "--kv-heads", "2"])
    (case,) = bench.build_cases(args, 4)
    want = attention_flops(1, 8, 4096, 4096, 128, True, "step") // 4
    assert bench.case_flops(args, case) == want


@pytest.mark.parametrize("argv, words", [
    (["--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
    (["--peers", "ferrocupy,flash"], "unknown peers"),
    (["--seq", "0"], "positive integers"),
    (["--tokens-per-gpu", "16k"], "integers"),
    (["--mode", "diagonal"], "invalid choice"),
])
def test_bad_arguments_exit_with_a_message(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--tokens-per-gpu" in capsys.readouterr().out


def test_dry_run_prints_the_cases_without_torch_distributed(capsys):
    assert bench.main(["--dry-run", "--world", "2", "--mode", "strong", "--seq", "4096",
                       "--direction", "fwd"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [{"mode": "strong", "seq": 4096, "world": 2, "direction": "fwd",
                     "local": 2048, "tflop_per_gpu": attention_flops(1, 16, 4096, 4096, 128,
                                                                     True) / 2 / 1e12}]
