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
    # A table per section (or keys at the top level, as files before sections); flags beside --config win.
    path.write_text('model = "tiny"\n[parallelism]\ndp = 2\ntp = 2\nsp = true\n[training]\nsteps = 9\n')
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
    ("dp = 2\n[parallelism]\ndp = 4\n", r"--config .*run.toml: dp is given twice \(2 and 4\); keep one"),
    ("[parallelism.b]\ndp = 2\n", r"--config .*run.toml: \[parallelism.b\] is a table in a table; the fields sit in "
                                  r"their section's table \(\[parallelism\]\) or at the top level"),
    ("[parallel]\ndp = 2\n", r"--config .*run.toml: \[parallel\] is not a section of a run; the tables are "
                             r"\[parallelism\], \[model\], \[training\], \[data\], \[moe\], \[checkpoint\], \[run\]"),
    ("[training]\ntop_k = 2\n", r"--config .*run.toml: top_k is a moe field: it goes in \[moe\], not \[training\]"),
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
    path.write_text('model = "small"\n[parallelism]\ndp = 2\ntp = 2\nsp = true\n[training]\nbatch = 8\n'
                    'seq = 256\nsteps = 100\n[checkpoint]\nsave_every = 10\n')
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


# Every flag dtp train and dtp plan took before their flags were made from RunConfig's
# fields (main at ad09ee5, 2026-12-01): each still parses, to the same field.
TRAIN_FLAGS_BEFORE = """
--async-save --async-tp --aux-loss-coeff --batch --bucket-mb --capacity-factor --check --clip --compile --config
--cp --cp-algo --cp-head-chunks --cp-window --data --data-dtype --debug --document-mask --dp --dtype --eos-id --ep
--ep-overlap --eval-every --expert-tp --ignore-memory-check --init-from --keep --log-every --lr --max-restarts
--max-skipped --memory-gb --microbatches --model --multi-data --multi-stream --n-groups --no-async-save
--no-async-tp --no-debug --no-document-mask --no-ep-overlap --no-expert-tp --no-multi-stream
--no-overlap-grad-reduce --no-overlap-param-gather --no-pipe-experts --no-reshard-after-forward --no-resume --no-sp
--no-tensorboard --nproc --num-experts --out --overlap-grad-reduce --overlap-param-gather --overwrite
--pipe-experts --pp --pp-schedule --precision --print-config --print-schedule --recompute --reshard-after-forward
--resume --routed-scaling-factor --router-bias-update --router-score --save-every --seed --seq --sp --steps
--tensorboard --timeout --tokenizer --top-k --topk-group --tp --ulysses-degree --virtual-stages --warmup
--weight-decay --zero --zero-prefetch
""".split()
PLAN_FLAGS_BEFORE = [f for f in TRAIN_FLAGS_BEFORE if f not in (
    "--async-save --no-async-save --check --debug --no-debug --eval-every --ignore-memory-check --keep --log-every "
    "--max-restarts --out --overwrite --print-config --resume --no-resume --save-every --tensorboard "
    "--no-tensorboard --timeout").split()] + ["--backend"]
# Flags added since, each a RunConfig field: train only (how a run ends, not what it plans).
TRAIN_FLAGS_SINCE = ["--save-on-signal", "--shutdown-timeout"]
# Plan-only flags added since, none a RunConfig field (the machine the step runs on, not the
# run), by the attribute each sets.
PLAN_FLAGS_SINCE = {"--hardware": "hardware_spec", "--calibrate": "calibrate", "--search": "search",
                    "--devices": "devices", "--show": "show"}


def _options(command: str) -> dict[str, str]:
    import argparse

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o: a.dest for a in sub.choices[command]._actions for o in a.option_strings if o not in ("-h", "--help")}


@pytest.mark.parametrize("command, before", [("train", TRAIN_FLAGS_BEFORE + TRAIN_FLAGS_SINCE),
                                             ("plan", PLAN_FLAGS_BEFORE)])
def test_every_flag_of_before_sets_the_field_it_set(command, before) -> None:
    def field(flag: str) -> str:  # the field a flag set before: its name with '_', less a --no-
        return "config_file" if flag == "--config" else flag[2:].removeprefix("no-").replace("-", "_")

    since = PLAN_FLAGS_SINCE if command == "plan" else {}
    assert _options(command) == {flag: field(flag) for flag in before} | since
    # And each field's flag is made from it: a field's flags set it, on / off alike.
    args = cli.build_parser().parse_args([command, "--dp", "3", "--no-reshard-after-forward", "--compile",
                                          "--cp-window", "2", "--capacity-factor", "1.5"])
    assert (args.dp, args.reshard_after_forward, args.compile, args.cp_window, args.capacity_factor) == \
        (3, False, "inductor", 2, 1.5)


def test_flags_are_not_abbreviated(capsys) -> None:
    # argparse's allow_abbrev took --micro for --microbatches: a flag added later that shares
    # the prefix would silently change what an old command line means.
    assert cli.main(["train", "--micro", "2"]) == 2
    assert "unrecognized arguments: --micro 2" in capsys.readouterr().err
    assert cli.main(["plan", "--dp", "2", "--zero", "3", "--zero-pre", "2"]) == 2  # a valid run, abbreviated
    assert "unrecognized arguments: --zero-pre 2" in capsys.readouterr().err
    import argparse

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == ["check", "export", "plan", "train"]
    assert all(p.allow_abbrev is False for p in [cli.build_parser(), *sub.choices.values()])


def test_train_help_lists_the_fields_by_section_with_their_docs(capsys) -> None:
    import dataclasses
    import re

    from dtp.config import SECTIONS

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    titles = [line[:-1] for line in text.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    assert titles == ["options", *SECTIONS.values(), "memory check (dtp plan runs first)"]
    flat = " ".join(text.split())
    # Compared without whitespace: argparse wraps lines, and at a hyphen too.
    by_section = {title: "".join(part.split()) for title, part in
                  zip(titles, re.split(r"^\S.*:$", text, flags=re.M)[1:])}
    for f in dataclasses.fields(RunConfig):
        doc = "".join(f.metadata["doc"].split())
        assert doc in by_section[SECTIONS[f.metadata["section"]]], f.name
        assert flat.count(f"--{f.name.replace('_', '-')} ") >= 1
