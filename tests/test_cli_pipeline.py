"""`dtp train --pp N --pp-schedule … --virtual-stages V --microbatches M [--print-schedule]`."""

import json

import pytest

import cli_pool
from dtp.cli import main, parse_args


def test_print_schedule_shows_each_ranks_actions(capsys) -> None:
    assert main(["train", "--pp", "2", "--microbatches", "4", "--print-schedule"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["rank 0: F0.0 F0.1 .    B0.0 F0.2 B0.1 F0.3 B0.2 .    B0.3",
                       "rank 1: .    F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3"]


@pytest.mark.parametrize("flags, match", [
    (["--pp", "2", "--microbatches", "1"], r"'1f1b' needs at least p=2 microbatches"),
    (["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3", "--batch", "6"],
     r"multiple of"),
    (["--pp", "2", "--virtual-stages", "2", "--microbatches", "2"], r"--virtual-stages 2 needs --pp-schedule interleaved"),
    (["--virtual-stages", "2"], r"need --pp > 1"),
    (["--pp", "2", "--pp-schedule", "interleaved", "--microbatches", "2"],
     r"^--pp-schedule interleaved runs --virtual-stages model chunks per pipeline rank: it needs --virtual-stages >= 2 "),
    (["--pp", "2", "--pp-schedule", "zbv", "--virtual-stages", "3", "--microbatches", "2"],
     r"'zbv' holds two chunks per rank \(a V: stages r and 2p-1-r\), got v=3"),
    (["--pp", "2", "--pp-schedule", "dualpipev", "--microbatches", "2"], r"'dualpipev' needs at least 2p=4 microbatches"),
])
def test_pipeline_flag_errors(flags, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_args(["train", *flags])


@pytest.mark.parametrize("flags, m", [
    ([], 1), (["--pp", "2"], 2), (["--pp", "4", "--pp-schedule", "gpipe"], 4),
    (["--pp", "2", "--pp-schedule", "dualpipev"], 4), (["--pp", "2", "--microbatches", "8"], 8),
])
def test_microbatches_default_to_what_keeps_every_stage_busy(flags, m, capsys) -> None:
    # `--pp 2` alone was refused (1f1b needs 2 microbatches in flight, the default was 1).
    args = parse_args(["train", *flags])
    assert args.microbatches == args.run_config.microbatches == m
    assert main(["plan", *flags]) == 0
    assert f"microbatches={m}" in capsys.readouterr().out
    # --print-config leaves a derived count out: the printed run still reads with another --pp
    assert main(["train", *flags, "--print-config"]) == 0
    assert ("microbatches = " in capsys.readouterr().out) == ("--microbatches" in flags)


@pytest.mark.parametrize("flags, m", [
    (["--pp", "3"], 4), (["--pp", "4", "--batch", "6"], 6), (["--pp", "2", "--dp", "2", "--batch", "12"], 2),
    (["--pp", "3", "--pp-schedule", "interleaved", "--virtual-stages", "2", "--batch", "12"], 3),
    (["--pp", "2", "--ep", "2", "--model", "tiny-moe", "--batch", "8"], 2),
])
def test_the_default_is_the_next_count_that_splits_the_batch(flags, m) -> None:
    # --pp 3 at --batch 8: 3 microbatches cannot split 8 rows, 4 can (and keep every stage busy)
    assert parse_args(["train", *flags]).microbatches == m


@pytest.mark.parametrize("flags, match", [
    (["--pp", "4", "--batch", "3"], r"^--batch 3 must be divisible by --dp × --microbatches = 1 × 4 \(the default "
                                    r"under --pp 4 1f1b\)"),
    # up to twice the fewest: 7 rows are not cut in 7 microbatches of one row
    (["--pp", "2", "--batch", "7"], r"^--batch 7 must be divisible by --dp × --microbatches = 1 × 2 \(the default"),
    (["--model", "tiny-moe", "--pp", "2", "--ep", "2", "--batch", "2"],
     r"^--batch 2 must be divisible by --dp × --ep × --microbatches = 1 × 2 × 2 \(the default under --pp 2 1f1b\)"),
])
def test_a_batch_no_default_count_splits_says_it_is_the_default(flags, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_args(["train", *flags])


def test_the_multi_data_refusal_offers_fewer_microbatches_only_where_there_are() -> None:
    flags = ["train", "--model", "tiny-moe", "--pp", "2", "--ep", "2", "--pipe-experts", "--multi-data", "64",
             "--seq", "16", "--print-config"]
    from dtp.cli.flags import check_config
    for extra, fewer in (([], False), (["--microbatches", "2"], False), (["--microbatches", "4"], True)):
        with pytest.raises(ValueError, match="use --multi-data <= ") as e:
            check_config(parse_args(flags[:-1] + extra))
        assert ("or fewer --microbatches" in str(e.value)) == fewer
    # gpipe runs one microbatch at any --pp: two given are one too many
    with pytest.raises(ValueError, match="use --multi-data <= ") as e:
        check_config(parse_args(flags[:-1] + ["--pp-schedule", "gpipe", "--microbatches", "2"]))
    assert "or fewer --microbatches" in str(e.value)


def test_pp_alone_trains_as_one_device(tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    result = cli_pool.train(monkeypatch, "--nproc", "2", "--pp", "2", "--steps", "2", "--dtype", "float64",
                            "--check", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "float64, 2 microbatches, writing" in result.stdout
    assert json.loads((out / "config.json").read_text())["microbatches"] == 2


def test_print_schedule_shows_the_v_and_its_pairs(capsys) -> None:
    assert main(["train", "--pp", "2", "--pp-schedule", "dualpipev", "--microbatches", "4", "--print-schedule"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("dualpipev schedule, pp=2, virtual stages 2, 4 microbatches")
    assert out[1].split()[2:5] == ["F0.0", "F0.1", "F0.2"] and "F0.3&B1.1" in out[1]


def test_plan_prints_the_schedule_after_its_table(capsys) -> None:
    """``dtp plan`` shares train's pipeline flags; its --print-schedule was accepted and
    ignored (with --pp 1 too)."""
    assert main(["plan", "--pp", "2", "--microbatches", "2", "--print-schedule"]) == 0
    out = capsys.readouterr().out
    assert "pipeline bubble" in out and out.index("pipeline bubble") < out.index("1f1b schedule, pp=2")
    assert "rank 1: .    F0.0 B0.0 F0.1 B0.1" in out
    assert main(["plan", "--print-schedule"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dtp plan: error: --print-schedule prints the pipeline's schedule; pipeline options need --pp > 1"]


def test_print_schedule_leaves_run_directories_alone(tmp_path, monkeypatch, capsys) -> None:
    # It prints and exits: no runs/<timestamp> made in the working directory, and with
    # --overwrite an earlier run's files stay (they were deleted before the schedule printed).
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--pp", "2", "--microbatches", "2", "--print-schedule"]) == 0
    assert list(tmp_path.iterdir()) == []
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    for flags in (["--overwrite"], []):  # not refused as a non-empty --out either
        assert main(["train", "--pp", "2", "--microbatches", "2", "--print-schedule", "--out", str(run), *flags]) == 0
        assert (run / "metrics.jsonl").read_text() == "{}\n"
    assert capsys.readouterr().out.count("1f1b schedule, pp=2") == 3


def test_under_torchrun_rank_0_alone_prints(monkeypatch, capsys) -> None:
    # Every rank of `torchrun ... -m dtp.cli train --print-schedule / --print-config` checks
    # the run; one copy is printed (two ranks' TOML in one file repeat every key).
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", rank)
        for flag in ("--print-schedule", "--print-config"):
            assert main(["train", "--pp", "2", "--microbatches", "2", flag]) == 0
        out = capsys.readouterr().out
        assert (out.count("1f1b schedule, pp=2"), out.count("pp = 2\n")) == ((0, 0) if rank == "1" else (1, 1))


def test_too_few_layers_is_one_line(capsys) -> None:
    assert main(["train", "--pp", "4", "--pp-schedule", "interleaved", "--virtual-stages", "2",
                 "--microbatches", "4", "--print-schedule"]) == 2
    assert ("--pp 4 --virtual-stages 2: 8 pipeline stages, but --model tiny cuts into 4 layers (the embedding, its 2 "
            "blocks, the head) and every stage needs one; use fewer stages") in capsys.readouterr().err


def test_pp2_tp2_sp_trains_and_matches_one_process(tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    proc = cli_pool.train(monkeypatch, "--nproc", "4", "--pp", "2", "--tp", "2", "--sp", "--pp-schedule", "zb-h1",
                          "--microbatches", "2", "--model", "tiny", "--steps", "3", "--batch", "4", "--seq", "16",
                          "--dtype", "float64", "--check", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": OK" in proc.stdout
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["comm_bytes"]["pp"]["send"] > 0



def _evals(out) -> list[float]:
    """The held-out losses a run wrote to its metrics."""
    return [r["eval_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r.get("eval_loss") is not None]

def test_dualpipev_checks_and_its_eval_loss_is_one_process(tmp_path, monkeypatch) -> None:
    """``dtp train --pp 2 --pp-schedule dualpipev --microbatches 4 --eval-every 2 --check``
    (ranks from the test pool): training equals one process, and the held-out losses of
    the forward-only schedule equal the one-process run's (fp64, 1e-10)."""
    flags = ["--model", "tiny", "--steps", "3", "--batch", "8", "--seq", "16", "--dtype", "float64", "--eval-every", "2"]
    pp, one = tmp_path / "pp", tmp_path / "one"
    run = cli_pool.train(monkeypatch, *flags, "--pp", "2", "--pp-schedule", "dualpipev", "--microbatches", "4",
                         "--check", "--out", str(pp))
    assert run.returncode == 0 and ": OK" in run.stdout, run.stdout + run.stderr
    assert cli_pool.train(monkeypatch, *flags, "--out", str(one)).returncode == 0

    assert len(_evals(pp)) == 2
    assert _evals(pp) == pytest.approx(_evals(one), rel=1e-10, abs=0)


@pytest.mark.slow  # ~25 s on 2 cores; tests/test_moe_pipeline.py checks the same aux in the default run
def test_moe_eval_loss_under_pp2_ep2_is_one_process(tmp_path, monkeypatch) -> None:
    """``dtp train --model tiny-moe --pp 2 --ep 2 --eval-every 2``: the held-out loss is
    the LM loss, as one process reports it (fp64, 1e-10). The forward-only schedule
    answered aux ``None``, and the loop read the loss with the aux terms added."""
    flags = ["--model", "tiny-moe", "--steps", "2", "--batch", "8", "--seq", "16", "--dtype", "float64",
             "--eval-every", "2", "--microbatches", "2"]
    pp, one = tmp_path / "pp", tmp_path / "one"
    assert cli_pool.train(monkeypatch, *flags, "--pp", "2", "--ep", "2", "--out", str(pp)).returncode == 0
    assert cli_pool.train(monkeypatch, *flags, "--out", str(one)).returncode == 0

    assert len(_evals(pp)) == 1
    assert _evals(pp) == pytest.approx(_evals(one), rel=1e-10, abs=0)
