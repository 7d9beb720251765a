"""`dtp train --num-experts E --top-k K [--capacity-factor C]` and `--model tiny-moe`:
the routing metrics reach metrics.jsonl and the step line (ranks from the test pool:
tests/cli_pool.py)."""

import json

import pytest

import cli_pool

from dtp.cli import parse_args, train_argv


def test_moe_flags_override_the_preset_and_travel_to_the_ranks() -> None:
    args = parse_args(["train", "--num-experts", "8", "--top-k", "1", "--capacity-factor", "1.5"])
    assert args.run_config.model_overrides() == {"num_experts": 8, "top_k": 1, "capacity_factor": 1.5}
    argv = train_argv(args)
    assert argv[argv.index("--num-experts") + 1] == "8" and argv[argv.index("--capacity-factor") + 1] == "1.5"
    assert parse_args(["train"]).run_config.model_overrides() == {}


@pytest.mark.parametrize("flags", [["--top-k", "0"], ["--capacity-factor", "0"], ["--num-experts", "-1"]])
def test_bad_moe_values_exit_2(flags) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["train", *flags])
    assert e.value.code == 2


def test_an_moe_run_reports_its_routing(tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    proc = cli_pool.train(monkeypatch, "--nproc", "2", "--ep", "2", "--model", "tiny-moe", "--steps", "2", "--batch", "4",
                          "--seq", "16", "--dtype", "float64", "--check", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " aux " in proc.stdout and " load " in proc.stdout and ": OK" in proc.stdout
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["lm_loss"] < record["loss"] and record["expert_imbalance"] >= 1.0
    assert record["dropped_fraction"] == 0.0  # dropless by default
    assert record["comm_bytes"]["ep"]["all_to_all_v"] > 0  # the tokens went to their experts' rank


@pytest.mark.parametrize("flags, words", [
    (["--pipe-experts"], "--pipe-experts configures the expert-parallel layout: it needs --ep > 1, got --ep 1"),
    (["--pipe-experts", "--multi-data", "2", "--tp", "2", "--expert-tp"],
     "--pipe-experts and --multi-data configure the expert-parallel layout: they need --ep > 1"),
    (["--ep", "2", "--multi-data", "2"], "it needs --pipe-experts"),
    (["--ep", "2", "--pipe-experts", "--multi-stream"], "it needs --tp > 1 --sp"),
    (["--ep", "2", "--expert-tp"], "it needs --tp > 1"),
])
def test_pipe_expert_flags_are_checked_before_any_rank_starts(flags, words) -> None:
    from dtp.cli.flags import UsageError

    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        parse_args(["train", "--model", "tiny-moe", *flags])


def test_pipe_experts_over_tp_with_multi_stream_trains_as_one_process(tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    proc = cli_pool.train(monkeypatch, "--nproc", "4", "--ep", "2", "--tp", "2", "--sp", "--expert-tp", "--pipe-experts",
                          "--multi-data", "2", "--multi-stream", "--model", "tiny-moe", "--steps", "2", "--batch", "4",
                          "--seq", "16", "--dtype", "float64", "--check", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": OK" in proc.stdout
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["comm_bytes"]["ep"]["all_to_all_v"] > 0 and record["comm_bytes"]["tp"]["all_gather"] > 0
