"""``dtp.RunConfig``: one description of a run that the CLI fills, the ranks receive, the
plan reads and the run directory and checkpoints record; ``dtp train --config`` / ``--print-config``."""

from __future__ import annotations

import json

import pytest

import dtp
from dtp import cli, launch
from dtp.cli.flags import read_config_file
from dtp.config import RunConfig, to_toml


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", launch.ERROR_DIR_ENV):
        monkeypatch.delenv(k, raising=False)


def test_fields_are_the_flags_and_checks_speak_either_language() -> None:
    with pytest.raises(ValueError, match=r"^RunConfig: cp_window configures context parallel: it needs cp > 1"):
        RunConfig(cp_window=2)
    with pytest.raises(ValueError, match=r"^--cp-window configures context parallel: it needs --cp > 1"):
        cli.parse_args(["train", "--cp-window", "2"])
    with pytest.raises(ValueError, match=r"dtype must be one of float32, float64, bfloat16; got 'fp8'"):
        RunConfig(dtype="fp8")
    with pytest.raises(ValueError, match=r"steps must be an integer, got 2.5"):
        RunConfig(steps=2.5)
    with pytest.raises(ValueError, match=r"^--async-tp overlaps sequence parallel's all-gathers / reduce-scatters "
                                         r"with the matmuls: it needs --tp > 1 --sp$"):
        cli.parse_args(["train", "--tp", "2", "--async-tp"])


def test_the_cli_layout_mesh_and_argv_come_from_the_config() -> None:
    args = cli.parse_args(["train", "--dp", "2", "--cp", "2", "--cp-algo", "double_ring", "--cp-window", "2",
                           "--seq", "64"])
    rc = args.run_config
    assert isinstance(rc, RunConfig) and rc.cp_window == 2
    assert cli.build_layout(args) == rc.layout() and cli.mesh_axes(args) == rc.mesh_axes() == {"dp": 2, "cp": 2}
    # Its argv states the same run (the command a run directory records).
    assert cli.parse_args(rc.argv()).run_config == rc


def test_toml_round_trip_and_flags_override_it(tmp_path, capsys) -> None:
    rc = RunConfig(dp=2, tp=2, sp=True, zero=1, lr=1e-3, model="small", cp=1, steps=7)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(rc))
    assert RunConfig.from_dict(read_config_file(str(path))) == rc
    # Tables group keys as a reader likes; flags beside --config win.
    path.write_text('model = "tiny"\n[parallel]\ndp = 2\ntp = 2\nsp = true\n[training]\nsteps = 9\n')
    args = cli.parse_args(["train", "--config", str(path), "--steps", "4"])
    assert (args.run_config.dp, args.run_config.tp, args.run_config.sp, args.run_config.steps) == (2, 2, True, 4)
    assert args.nproc == 4
    # --print-config prints what --config reads back, and starts nothing.
    assert cli.main(["train", "--config", str(path), "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "again.toml").write_text(printed)
    assert RunConfig.from_dict(read_config_file(str(tmp_path / "again.toml"))) == \
        cli.parse_args(["train", "--config", str(path)]).run_config
    # A warm-up derived from --steps is printed as derived: the file reads with fewer steps.
    assert "warmup" not in printed
    assert cli.parse_args(["train", "--config", str(tmp_path / "again.toml"), "--steps", "3"]).run_config.warmup == 3
    assert cli.main(["train", "--warmup", "2", "--print-config"]) == 0
    assert "warmup = 2" in capsys.readouterr().out.splitlines()
    # So is the precision derived from --dtype (mixed for bf16): the file reads with --dtype float32.
    assert cli.main(["train", "--dtype", "bfloat16", "--print-config"]) == 0
    (tmp_path / "bf16.toml").write_text(capsys.readouterr().out)
    assert cli.parse_args(["train", "--config", str(tmp_path / "bf16.toml")]).run_config.precision == "mixed"
    as_fp32 = cli.parse_args(["train", "--config", str(tmp_path / "bf16.toml"), "--dtype", "float32"])
    assert as_fp32.run_config.precision is None
    # Only a run that passes the checks is printed (the file would be refused when read).
    assert cli.main(["train", "--tp", "3", "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "heads=4 is not divisible by tp=3" in captured.err


@pytest.mark.parametrize("text, match", [
    ("dpp = 2\n", r"--config .*run.toml: unknown key 'dpp'"),
    ("dp = \n", r"--config .*run.toml: not valid TOML"),
    ('dp = "two"\n', r"--config .*run.toml: dp must be an integer, got 'two'"),
    ("[parallel]\ndp = 2\n[more]\ndp = 4\n", r"--config .*run.toml: dp is given twice \(2 and 4\); keep one"),
    ("[a.b]\ndp = 2\n", r"--config .*run.toml: \[a.b\] is a table in a table; the fields sit at the top level"),
])
def test_a_bad_config_file_is_one_line(tmp_path, capsys, text, match) -> None:
    import re

    path = tmp_path / "run.toml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err), err
    assert cli.main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_compile_true_in_a_config_file_is_the_bare_flag(tmp_path) -> None:
    path = tmp_path / "run.toml"
    for text, backend in (("compile = true\n", "inductor"), ("compile = false\n", None),
                          ('compile = "aot_eager"\n', "aot_eager")):
        path.write_text(text)
        assert cli.parse_args(["train", "--config", str(path)]).run_config.compile == backend


def test_dtp_plan_reads_a_config_file_as_train_does(tmp_path, capsys) -> None:
    """``dtp plan --config run.toml`` plans the run ``dtp train --config run.toml`` trains,
    its fields beyond plan's flags included; flags beside it override it."""
    path = tmp_path / "run.toml"
    path.write_text('model = "small"\n[parallel]\ndp = 2\ntp = 2\nsp = true\n[training]\nbatch = 8\nseq = 256\n'
                    'steps = 100\n[checkpoints]\nsave_every = 10\n')
    plans = []
    for argv in (["--config", str(path)], ["--model", "small", "--dp", "2", "--tp", "2", "--sp", "--batch", "8",
                                          "--seq", "256"]):
        assert cli.main(["plan", *argv]) == 0
        plans.append(capsys.readouterr().out)
    assert plans[0] == plans[1] and plans[0].startswith("small (3.3M params), batch 8 × seq 256 on 4 ranks")
    assert cli.main(["plan", "--config", str(path), "--tp", "1"]) == 2  # --sp still from the file
    assert "--sp (sequence parallel) splits the sequence over the tp group" in capsys.readouterr().err
    assert cli.main(["plan", "--out", "x"]) == 2  # a train flag plan has not: said by plan's parser
    assert capsys.readouterr().err == "dtp plan: error: unrecognized arguments: --out x (see dtp plan --help)\n"


def test_plan_reads_a_run_config() -> None:
    rc = RunConfig(dp=2, tp=2, sp=True, cp=2, cp_algo="ulysses", batch=8, seq=32)
    p = dtp.plan(rc)
    assert p.target.layout == rc.layout() and p.target.context.algo == "ulysses" and p.run is rc
    assert p.bytes == dtp.plan("tiny", batch=8, seq=32, dp=2, tp=2, sp=True, cp=2, cp_algo="ulysses").bytes
    with pytest.raises(TypeError, match="a RunConfig is the whole run"):
        dtp.plan(rc, dp=4)


def test_ranks_receive_the_config_and_the_run_records_it(tmp_path, monkeypatch) -> None:
    """Through the launcher (ranks from the test pool: tests/cli_pool.py): the ranks get the
    run as one TOML file (not re-spelled flags); config.json and every checkpoint record its
    fields."""
    import cli_pool

    out = tmp_path / "run"
    proc = cli_pool.train(monkeypatch, "--nproc", "2", "--dp", "2", "--steps", "2", "--batch", "4", "--seq", "16",
                          "--save-every", "2", "--lr", "0.002", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recorded = json.loads((out / "config.json").read_text())
    rc = RunConfig.from_dict(recorded, strict=False)
    assert (rc.dp, rc.lr, rc.save_every, rc.out) == (2, 0.002, 2, str(out))
    manifest = next((out / "checkpoints").glob("*/manifest.json"))
    assert json.loads(manifest.read_text())["extra"]["run"]["lr"] == 0.002


def test_precision_is_a_field_its_rules_are_said_before_any_rank_starts() -> None:
    rc = RunConfig(dtype="bfloat16", precision="mixed", dp=2)
    assert rc.layout().precision is not None
    assert RunConfig(dtype="bfloat16", precision="pure").layout().precision is None
    # bf16 alone is mixed, as Megatron's --bf16: pure bf16 loses every update below half an ulp
    assert RunConfig(dtype="bfloat16").precision == "mixed" and RunConfig(dtype="bfloat16").layout().precision
    assert RunConfig(dtype="bfloat16", zero=1, dp=2).precision == "mixed" and RunConfig().precision is None
    assert cli.parse_args(rc.argv()).run_config == rc
    with pytest.raises(ValueError, match=r"^--precision mixed keeps fp32 master weights beside bf16 parameters: "
                                         r"it needs --dtype bfloat16, got --dtype float32"):
        cli.parse_args(["train", "--precision", "mixed"])
    with pytest.raises(ValueError, match=r"^RunConfig: precision pure is not available with zero 1: ZeRO's"):
        RunConfig(dtype="bfloat16", precision="pure", zero=1, dp=2)
    with pytest.raises(ValueError, match=r"precision must be one of pure, mixed; got 'fp8'"):
        RunConfig(precision="fp8")


def test_a_seed_torch_cannot_take_is_refused_before_any_rank_starts() -> None:
    # Before, --seed 2**64 passed every check and each rank failed in torch.manual_seed with
    # "Overflow when unpacking long long", a line that names no flag.
    for seed in (2**63, -(2**63) - 1, 10**30):
        with pytest.raises(ValueError, match=rf"^--seed must lie in \[-2\*\*63, 2\*\*63\), got {seed}"):
            cli.parse_args(["train", "--seed", str(seed)])
    assert RunConfig(seed=2**63 - 1).seed == 2**63 - 1 and RunConfig(seed=-1).seed == -1  # torch takes both
