"""Layouts' typed options: frozen, keyword-only, checked when built, each family given once,
and the one place the names users pick from are written."""

import dataclasses
import re
import typing
import warnings

import pytest

import dtp
from dtp import layouts
from dtp.layouts import CP_ALGORITHMS, LOAD_BALANCE, ZERO_STAGES, ContextOptions, MegatronOptions, ZeroOptions


class _Mesh:
    """Just what layouts read from a DeviceMesh (names and sizes), so no ranks are needed."""

    def __init__(self, **axes: int) -> None:
        self.mesh_dim_names, self._sizes = tuple(axes), tuple(axes.values())

    def size(self, dim: int) -> int:
        return self._sizes[dim]


@pytest.mark.parametrize("opts", [ContextOptions(), ZeroOptions(), MegatronOptions(), layouts.data()])
def test_options_and_layouts_are_frozen(opts) -> None:
    name = dataclasses.fields(opts)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(opts, name, getattr(opts, name))


@pytest.mark.parametrize("cls", [ContextOptions, ZeroOptions, MegatronOptions])
def test_options_are_keyword_only(cls) -> None:
    with pytest.raises(TypeError):
        cls(1)


def test_options_check_themselves_when_built() -> None:
    with pytest.raises(ValueError, match=r"layouts.zero: stage must be 0, 1, 2 or 3, got 4"):
        ZeroOptions(stage=4)
    with pytest.raises(ValueError, match="layouts.zero: prefetch is a stage-3 option"):
        ZeroOptions(stage=2, prefetch=2)
    with pytest.raises(ValueError, match="layouts.context: algo must be one of"):
        ContextOptions(algo="spiral")
    with pytest.raises(ValueError, match="layouts.context: load_balance must be 'zigzag' or None, got 'round'"):
        ContextOptions(load_balance="round")
    with pytest.raises(ValueError, match="hybrid needs ulysses_degree > 1"):
        ContextOptions(algo="hybrid")
    with pytest.raises(TypeError, match="layouts.megatron: sequence_parallel must be a bool"):
        MegatronOptions(sequence_parallel="yes")
    with pytest.raises(ValueError, match="layouts.megatron: async_tp .* needs sequence_parallel=True"):
        MegatronOptions(async_tp=True)
    assert ZeroOptions(bucket_mb=8) == ZeroOptions(bucket_mb=8.0)  # canonical once built
    with pytest.raises(TypeError):  # a misspelt option is not silently dropped
        layouts.zero(1, bucket_size=8)


def test_presets_hold_their_options_and_defaults_come_from_the_dataclass() -> None:
    assert layouts.zero().zero == ZeroOptions()
    assert layouts.context().context == ContextOptions()
    assert layouts.megatron().megatron == MegatronOptions()
    assert layouts.context("ulysses", axis="sp").context == ContextOptions(algo="ulysses", axis="sp")
    assert layouts.zero(0) == layouts.data()  # stage 0 is plain data parallel: no ZeRO options


def test_composition_gives_each_family_once() -> None:
    ring, ulysses = layouts.context("ring"), layouts.context("ulysses")
    z1, z3 = layouts.zero(1), layouts.zero(3, prefetch=2)
    both = layouts.data() + ring + z1 + layouts.megatron(sequence_parallel=True)
    assert both.context is ring.context and both.zero is z1.zero and both.megatron.sequence_parallel
    kept = ring + z1 + layouts.data()  # the right side sets nothing: the left's options stay
    assert kept.context is ring.context and kept.zero is z1.zero and kept.megatron is None
    assert (both + layouts.zero(1)).zero == z1.zero  # the same options twice: one family
    # Different options of one family: their rules would merge while one side's options
    # won, so the layout would describe another run than the one its rules make.
    for other, said in [(ulysses, "context is given on both sides (algo='ring' vs 'ulysses')"),
                        (z3, "zero is given on both sides (stage=1 vs 3, prefetch=1 vs 2)"),
                        (layouts.megatron(), "megatron is given on both sides (sequence_parallel=True vs False)")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            both + other


def test_layout_options_are_typed_objects_it_iterates_one_per_family() -> None:
    layout = layouts.data() + layouts.megatron(True) + layouts.zero(1) + layouts.context("ring")
    assert [type(o).__name__ for o in layout.options] == ["ContextOptions", "MegatronOptions", "ZeroOptions"]
    assert all(isinstance(o, dtp.layouts.Option) for o in layout.options)
    assert layout.zero is layout.option("zero") and layout.pipeline is None and layout.option("pipeline") is None
    assert {f.name for f in dataclasses.fields(dtp.Layout)} == {"params", "activations", "options", "name"}
    # every preset family is registered by its option class, none named by the Layout itself
    assert set(dtp.layouts.Option.families()) >= {"megatron", "context", "zero", "pipeline", "expert", "precision"}
    assert dtp.Layout(zero=layout.zero).options == (layout.zero,)
    assert dataclasses.replace(layout, name="renamed").options == layout.options  # a field like any other
    with pytest.raises(AttributeError, match="zerro"):
        layout.zerro  # a typo is not an absent option
    with pytest.raises(TypeError, match="unknown option family 'zerro'"):
        dtp.Layout(zerro=layout.zero)
    with pytest.raises(TypeError, match="zero= takes a ZeroOptions"):
        dtp.Layout(zero=layout.context)
    # dataclasses.replace names a family: it wins over the options it had (None drops it)
    assert dataclasses.replace(layout, zero=None).zero is None
    assert dataclasses.replace(layout, zero=dtp.layouts.ZeroOptions(stage=2)).zero.stage == 2
    with pytest.raises(TypeError, match="no Layout attribute, got 'degree'"):
        type("Shadow", (dtp.layouts.Option,), {"family": "degree"})  # it would hide Layout.degree


def test_zero_active_needs_a_stage_and_a_split_axis() -> None:
    opts = ZeroOptions(stage=2)
    assert opts.active(_Mesh(dp=2, tp=2))
    assert not opts.active(_Mesh(dp=1, tp=4)) and not opts.active(_Mesh(tp=4))
    assert not ZeroOptions(stage=0).active(_Mesh(dp=2))
    assert dtp.zero.options(layouts.zero(2), _Mesh(dp=2)) == opts  # the typed options themselves
    assert dtp.zero.options(layouts.zero(2), _Mesh(dp=1)) is None


def test_check_sizes_delegates_to_the_context_options() -> None:
    mesh = _Mesh(dp=1, cp=4, tp=2)
    layout = layouts.megatron() + layouts.context("ulysses")
    with pytest.raises(ValueError, match=r"model: heads=12 must be divisible by the Ulysses degree 4 × tp=2 = 8"):
        layout.check_sizes({"heads": 12}, mesh)
    layout.check_sizes({"heads": 16}, mesh)
    with pytest.raises(ValueError, match=r"net: heads=12 must be divisible"):
        layout.context.check({"heads": 12}, mesh, tp=2, what="net")
    layout.context.check({"heads": 12}, _Mesh(dp=8))  # no cp axis: nothing to check
    assert layout.context_degree(mesh) == 4 and layouts.data().context_degree(mesh) == 1


def test_context_options_is_typed_with_a_contiguous_ring_by_default() -> None:
    assert layouts.context_options() == ContextOptions(load_balance=None)
    layout = layouts.context("hybrid", ulysses_degree=2)
    with dtp.use_layout(layout, _Mesh(cp=4)):
        assert layouts.context_options() is layout.context


def test_choices_are_written_once() -> None:
    from dtp.ops.context import ALGORITHMS
    from dtp.layouts.context import CpAlgorithm, LoadBalance
    from dtp.layouts.zero import ZeroStage

    assert tuple(ALGORITHMS) == CP_ALGORITHMS  # the dispatch table offers exactly the layout's choices
    assert typing.get_args(CpAlgorithm) == CP_ALGORITHMS
    assert typing.get_args(ZeroStage) == ZERO_STAGES
    assert typing.get_args(LoadBalance) == LOAD_BALANCE == ("zigzag", None)


def test_zero_overlap_needs_a_stage() -> None:
    with pytest.raises(ValueError, match="overlap_grad_reduce / overlap_param_gather .* need stage 1, 2 or 3"):
        layouts.zero(0, overlap_param_gather=True)


def test_a_rule_naming_an_axis_no_preset_uses_warns_once() -> None:
    """A custom rule's mesh axis the mesh lacks is dropped (one layout serves every mesh);
    when no dtp preset uses that axis either it is likely a typo, said once as a warning."""
    from dtp.core.mesh.shape import MeshShape

    layout = dtp.layouts.data() + dtp.Layout({"vocab": ("tpp",)}, name="typo test")
    with pytest.warns(UserWarning, match=r"the rules for 'vocab' name mesh axis 'tpp', which no dtp preset uses "
                                         r"and this mesh lacks \(its axes: dp\)"):
        layout.check_mesh(MeshShape({"dp": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout.check_mesh(MeshShape({"dp": 1}))  # once per layout and mesh
        (dtp.layouts.data() + dtp.layouts.megatron()).check_mesh(MeshShape({"dp": 1}))  # 'tp': a preset's axis


def test_async_tp_takes_experts() -> None:
    # MoE ops fill the block entry's buffer before the router reads it (collective_matmul.filled)
    layout = layouts.megatron(sequence_parallel=True, async_tp=True) + layouts.expert(tp_axis="tp")
    layout.check_sizes({"heads": 4, "embed": 8, "expert": 4}, _Mesh(ep=2, tp=2))


def test_a_rule_given_as_one_string_names_one_mesh_axis() -> None:
    """``Layout({"embed": "dp"})`` iterated the string: axes 'd' and 'p', so the parameter
    stayed replicated and a warning called it a typo. One string is one axis, as in P."""
    assert dtp.Layout({"embed": "dp"}, {"batch": ["dp", "cp"]}).params == {"embed": ("dp",)}
    assert dtp.Layout(activations={"batch": ["dp", "cp"]}).activations == {"batch": ("dp", "cp")}
    with pytest.raises(TypeError, match=r"^Layout: the params rule for 'embed' must be a mesh axis name"):
        dtp.Layout({"embed": 3})
