"""Hardware as data (dtp.planning.hardware): every preset valid and exact through TOML, a
few figures pinned to their datasheets (so changing one is deliberate), the one-line errors
of an unknown name and of a bad field, ``dtp plan --hardware`` and ``--calibrate``."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtp.cli import build_parser
from dtp.planning.hardware import COLLECTIVES, PRESETS, Chip, Hardware, Link, from_toml, hardware
from dtp.planning.hardware_toml import to_toml


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_whole_and_round_trips(name: str) -> None:
    hw = PRESETS[name]
    assert isinstance(hw, Hardware) and hw.name == name and hw.devices_per_node == 8 and hw.source
    assert {"bfloat16", "float32"} <= set(hw.chip.flops)
    assert 0 < hw.chip.matmul_efficiency <= 1
    assert from_toml(to_toml(hw)) == hw
    assert hardware(name.upper()) is hw


def test_figures_against_their_datasheets() -> None:
    """Dense peaks and line rates as printed by NVIDIA / AMD, per device and each way."""
    a100, h100, h200, b200, mi = (PRESETS[n] for n in ("a100-80gb", "h100-sxm", "h200", "b200", "mi300x"))
    assert a100.chip.flops["bfloat16"] == 312e12 and a100.chip.memory_bandwidth == 2039e9
    assert a100.inter.bandwidth == 25e9  # 8 × HDR 200 Gb/s per node, 8 GPUs (Selene)
    assert a100.intra.bandwidth == 300e9  # NVLink3: 600 GB/s both ways
    assert h100.chip.flops["bfloat16"] == 989.4e12 and h100.chip.memory == 80e9
    assert h100.inter.bandwidth == 50e9 and h100.intra.bandwidth == 450e9
    assert h200.chip.flops == h100.chip.flops and h200.chip.memory == 141e9 and h200.chip.memory_bandwidth == 4.8e12
    assert b200.chip.flops["bfloat16"] == 2250e12 and b200.intra.bandwidth == 900e9
    assert mi.chip.flops["bfloat16"] == 1307.4e12 and mi.chip.memory == 192e9
    assert h100.chip.matmul_efficiency == 0.803  # MAMF: 794.5 / 989
    assert h100.intra.realised == pytest.approx(370e9)  # nccl-tests#212


def test_an_unknown_name_says_the_presets() -> None:
    with pytest.raises(ValueError, match=r"^unknown hardware 'tpu-v5': neither a preset \(a100-80gb, .*mi300x\) "
                                         r"nor a file$"):
        hardware("tpu-v5")


@pytest.mark.parametrize("edit, field", [
    (("memory = ", "memory = -"), "chip.memory"),
    (("latency = 0.0", "latency = \"fast\""), "host.latency"),
    (("[chip.flops]", "[chip.flops]\nbf16 = 1.0"), "chip.flops.bf16"),
    (("efficiency = 0.94", "efficiency = 1.5"), "inter.efficiency"),
    (("devices_per_node = 8", "devices_per_node = 8.0"), "devices_per_node"),
])
def test_a_bad_field_is_one_line_naming_it(edit: tuple[str, str], field: str) -> None:
    text = to_toml(PRESETS["h100-sxm"]).replace(*edit, 1)
    with pytest.raises(ValueError) as e:
        from_toml(text)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_a_missing_field_and_a_file(tmp_path: Path) -> None:
    text = re.sub(r"(\[intra\][^\n]*\n)bandwidth = [^\n]*\n", r"\1", to_toml(PRESETS["b200"]))
    with pytest.raises(ValueError, match="^hardware TOML: missing field intra.bandwidth$"):
        from_toml(text)
    path = tmp_path / "mine.toml"
    custom = dataclasses.replace(PRESETS["b200"], name="mine", chip=dataclasses.replace(
        PRESETS["b200"].chip, matmul_curve=((1e6, 0.25), (1e9, 0.75))))
    path.write_text(to_toml(custom))
    assert hardware(str(path)) == custom
    path.write_text("name = 1\n")
    with pytest.raises(ValueError, match=r"mine.toml: hardware TOML: missing field devices_per_node"):
        hardware(str(path))


def test_measured_terms_round_trip_and_check_themselves() -> None:
    """The attention curve, an op's fixed cost and a link's collective fixed costs are
    written only where given (a preset's TOML is as before), read back equal, and a bad
    one is named."""
    h100 = PRESETS["h100-sxm"]
    assert "attention_curve" not in to_toml(h100) and "collective_latency" not in to_toml(h100)
    mine = dataclasses.replace(
        h100, chip=dataclasses.replace(h100.chip, attention_curve=((8192.0, 0.3), (131072.0, 0.65)), op_overhead=4e-6),
        intra=dataclasses.replace(h100.intra, collective_latency=(("all_reduce", 2, 1e-3), ("all_to_all", 8, 5e-3))))
    assert from_toml(to_toml(mine)) == mine
    text = to_toml(mine)
    for edit, field in ((('["all_to_all", 8', '["all_to_all_v", 8'), "intra.collective_latency[1] kind"),
                        (('["all_reduce", 2', '["all_reduce", 1'), "intra.collective_latency[0] ranks"),
                        (('["all_to_all", 8', '["all_reduce", 2'), "collective_latency names a (kind, ranks) twice"),
                        (("op_overhead = 4e-06", "op_overhead = -1.0"), "chip.op_overhead"),
                        (("[131072.0, 0.65]", "[131072.0, 1.5]"), "chip.attention_curve[1].fraction")):
        with pytest.raises(ValueError, match=re.escape(field)):
            from_toml(text.replace(*edit))
    with pytest.raises(ValueError, match="collective_latency rows"):
        Link(bandwidth=1.0, latency=0.0, collective_latency=(("all_reduce", 2, -1.0),))
    with pytest.raises(ValueError, match="attention_curve"):
        dataclasses.replace(h100.chip, attention_curve=((10.0, 0.5), (1.0, 0.9)))


def test_the_types_check_themselves() -> None:
    with pytest.raises(ValueError, match="efficiency must be in"):
        Link(bandwidth=1.0, latency=0.0, efficiency=0.0)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        Chip(name="x", flops={"fp8": 1.0}, memory=1.0, memory_bandwidth=1.0, matmul_efficiency=1.0)
    with pytest.raises(ValueError, match="matmul_curve"):
        Chip(name="x", flops={"float32": 1.0}, memory=1.0, memory_bandwidth=1.0, matmul_efficiency=1.0,
             matmul_curve=((10.0, 0.5), (1.0, 0.9)))


def test_plan_parses_hardware() -> None:
    args = build_parser().parse_args(["plan", "--hardware", "h100-sxm"])
    assert args.hardware_spec is PRESETS["h100-sxm"] and args.calibrate is None
    assert build_parser().parse_args(["plan"]).hardware_spec is None


def test_plan_refuses_unknown_hardware_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "dtp.cli", "plan", "--hardware", "tpu-v5"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("dtp plan: error: argument --hardware: unknown hardware 'tpu-v5'")


def test_plan_calibrate_writes_what_hardware_reads(tmp_path: Path) -> None:
    """The whole calibration (a few seconds here; the rank pool is most of it)."""
    out = tmp_path / "here.toml"
    done = subprocess.run([sys.executable, "-m", "dtp.cli", "plan", "--calibrate", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    hw = hardware(str(out))
    assert hw.name == "cpu-calibrated" and hw.devices_per_node == 2 and hw.chip.matmul_efficiency == 1.0
    assert hw.chip.flops["float32"] > 1e8 and hw.intra.bandwidth > 1e6 and hw.chip.matmul_curve
    assert hw.chip.attention_curve and hw.chip.op_overhead > 0 and hw.intra.fixed("all_to_all", 2) > 0
    assert build_parser().parse_args(["plan", "--hardware", str(out)]).hardware_spec == hw


# Slow: 80 s of the default run's ~11 min on 2 cores (three ranks time every figure at
# once); test_plan_calibrate_writes_what_hardware_reads covers the calibration in the
# default run, and benchmarks/plan_vs_measured.py runs this path at 8 ranks.
@pytest.mark.slow
def test_calibrate_shared_measures_every_rank_at_once() -> None:
    """More ranks than cores (or ``shared=True``): the chip and the link measured on all the
    ranks at once, an odd rank out keeping the count; the figures are per rank."""
    from dtp import testing
    from dtp.planning.calibrate import calibrate

    try:
        hw = calibrate(3, repeats=3, shared=True)
    finally:
        testing.shutdown()
    assert hw.devices_per_node == 3 and "all 3 ranks at once" in hw.source
    assert hw.chip.flops["float32"] > 1e8 and hw.chip.memory_bandwidth > 1e7
    assert hw.intra.bandwidth > 1e6 and hw.intra.latency >= 0 and len(hw.chip.matmul_curve) == 4
    assert len(hw.chip.attention_curve) == 3 and 0 < hw.chip.op_overhead < 1e-3
    # every collective among the one group size dividing 3 ranks: 3
    assert sorted(k for k, n, _ in hw.intra.collective_latency) == sorted(COLLECTIVES)
    assert {n for _, n, _ in hw.intra.collective_latency} == {3} and hw.intra.fixed("all_reduce", 3) > 0
    with pytest.raises(ValueError, match="shared measurement needs ranks >= 2"):
        calibrate(1, shared=True)
