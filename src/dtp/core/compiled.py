"""The compiled step: which computation ``torch.compile`` traces, and what stays eager.

``train_step(..., compile=True)`` (``dtp train --compile``) does not wrap the loss:
torch 2.13 cannot trace DTensor's dispatch of a tp + SP model (``as_strided not
supported with DTensor``). Compiled regions are the **local computation** instead, and
dtp's collectives run between them, eagerly:

- **plain tensors** (a one-device mesh, a pipeline stage on one device, or a layout that
  splits only the batch — dp, ZeRO 1/2/3 — in local batch mode, :mod:`dtp.strategies.local`): each
  transformer block is one region — it starts and ends at :func:`dtp.ops.remat`'s block
  boundary, recomputed whole under ``recompute="full"``. The embedding and the head's
  loss run eagerly between the blocks.
- **DTensors** (every other layout): each :func:`dtp.local_map` body is one region — the
  attention core (local SDPA, or a context-parallel algorithm's local work), rotary, the
  embedding lookup, the vocab-parallel cross-entropy's local sums, the MoE experts.
  DTensor arithmetic between them (norms, residual adds, matmuls of the ``linear`` op, a
  builtin that compiling would not speed up) and every :func:`dtp.reshard` run eagerly.

What a region meets on its way:

- **dtp's collectives** (:mod:`dtp.comm`: every collective and ``CommHandle.wait``) are
  ``torch.compiler.disable``'d (:func:`eager`): each is a listed graph break, so a ring's
  send/recv or an expert dispatch's all-to-all inside a region splits it in two, and the
  comm log, the simulated link and the flight recorder see the same records as in eager.
- **ZeRO's lazy gathers** happen when ``loss_fn`` reads a parameter, outside any region
  (the region receives the gathered tensor), so they are neither traced nor breaks: a
  block region's parameters are read just before it starts (:func:`dtp.ops.remat`).
- **custom autograd Functions** (ring attention's, the expert dispatch's) that call a
  collective are a graph break at their ``apply``: dynamo runs the whole Function eagerly.
- **the pipeline's split backward** (zero-bubble and V schedules: input gradients first,
  weight gradients later, :mod:`dtp.strategies.pipeline_split`) composes without a break:
  a block's compiled backward is one autograd node on the input's path that also leads to
  the weights, so the weight pass restarts at it and runs it again (correct; the weight
  pass redoes that block's input-gradient part). Such regions donate no saved tensor to
  their backward (:func:`retaining_graph`), so it may run twice.

Recompiles are bounded: each region keeps its own cache (one code object per region), so
the regions do not share the recompile limit; with the default ``dynamic=None`` a region
whose shapes change is compiled once more with those dims dynamic (PyTorch's automatic
dynamic shapes), and ``dynamic=True`` (``dtp train`` picks it for MoE, whose dropless
expert batches change size every step) starts there. ``train_step``'s metrics count the
graphs compiled and the graph breaks met in that step (``compile_graphs``,
``compile_breaks``): after the first step any new graph is a recompile. ``dtp train
--compile --debug`` prints the break reasons and the recompiles (:func:`report`).

>>> f = region(lambda x: x.sin() * 2)             # no compiling(): the function itself
>>> f(torch.zeros(2)).tolist()
[0.0, 0.0]
>>> with compiling(CompileOptions(backend="eager")) as watch:
...     g = region(lambda x: x.cos() + 1)
...     y = g(torch.zeros(2))
>>> y.tolist(), watch.metrics()["compile_graphs"]
([2.0, 2.0], 1)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import sys
import threading
import types
from collections import Counter
from typing import Any, Callable, Iterator

import torch

from ._rules import COMPILE_BACKENDS as BACKENDS
from ._torch import disable_dynamo_lazily, dynamo_counters, no_donated_buffers

__all__ = ["BACKENDS", "CompileOptions", "options_of", "compiling", "active", "region", "retaining_graph", "Watch",
           "report", "eager"]

_state = threading.local()
# (code, options, retaining): a region compiled under retaining_graph() is another graph
# (no donated buffers) from the same code compiled outside it.
_cache: dict[tuple[types.CodeType, "CompileOptions", bool], Callable[..., Any]] = {}
# How many retaining_graph() contexts are open: a global, not a thread-local, because
# ep_overlap's lanes run forwards on their own threads under the pipeline's context (as
# collective_matmul's split_backward depth).
_retaining = [0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How regions are compiled: ``backend`` (one of :data:`BACKENDS`) and ``dynamic``
    (``None``: PyTorch's automatic dynamic shapes after a shape change; ``True``: dynamic
    from the start; ``False``: a recompile per shape).

    >>> CompileOptions(backend="aot_eager", dynamic=True).backend
    'aot_eager'
    """

    backend: str = "inductor"
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"compile backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.dynamic not in (None, True, False):
            raise ValueError(f"compile dynamic must be None, True or False; got {self.dynamic!r}")


def options_of(compile: bool | str | CompileOptions | None) -> CompileOptions | None:
    """``train_step``'s ``compile`` argument as options (``None``: eager): ``True`` is
    inductor, a string names the backend.

    >>> options_of(False), options_of("eager")
    (None, CompileOptions(backend='eager', dynamic=None))
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return CompileOptions()
    if isinstance(compile, str):
        return CompileOptions(backend=compile)
    if isinstance(compile, CompileOptions):
        return compile
    raise TypeError(f"compile must be a bool, a backend name or a dtp.CompileOptions; got {type(compile).__name__}")


def active() -> CompileOptions | None:
    """The options regions are compiled with here (``None``: eager)."""
    return getattr(_state, "options", None)


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as ``torch.compiler.disable(fn)`` wherever dynamo may trace it, else ``fn``:
    a decorator for module-level functions and methods (each stays registered).

    ``torch.compiler.disable`` imports ``torch._dynamo``: 0.95 s of CPU per process
    (measured, torch 2.13, a quiet 2-core machine: ``import torch`` 2.0 s, DTensor
    1.0 s), which every rank and the launcher would pay at import for a decorator that only a
    compiled step needs. (A run whose ops go through DTensor's dispatch, tp or cp, still
    imports it: DTensor's sharding propagation makes a ``FakeTensorMode``, which imports
    ``torch._dynamo.config``; so does ``torch.utils.checkpoint``, i.e. recompute. The
    launcher, ``dtp plan`` / ``check``, one device and dp / ZeRO in local batch mode do
    not.) So the disabled twin is made once dynamo is in the process: :func:`compiling`
    makes every twin before a region is traced and puts it where dtp's modules look the
    function up. A call traced before that (a user's own ``torch.compile`` around
    ``dtp.comm``, or another thread's compile: dynamo's flag is process-wide) goes
    through torch's lazily disabled wrapper: a graph break, ``fn`` run eagerly.

    >>> double = eager(lambda x: 2 * x)
    >>> double(torch.ones(1)).tolist()
    [2.0]
    """
    twin: list[Callable[..., Any] | None] = [None]
    lazily = disable_dynamo_lazily(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        disabled = twin[0]
        if disabled is not None:
            return disabled(*args, **kwargs)
        if torch.compiler.is_compiling():
            return lazily(*args, **kwargs)
        if "torch._dynamo" in sys.modules:
            _make_twins()
            return (twin[0] or fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    with _twins_lock:
        _eager_fns.append((fn, twin, call))
    return call


_eager_fns: list[tuple[Callable[..., Any], list[Callable[..., Any] | None], Callable[..., Any]]] = []
_twins_made = [0]  # how many of _eager_fns have their twin in place
_twins_lock = threading.Lock()  # lanes (dtp.ops.lanes) call collectives from threads


def _make_twins() -> None:
    """Each :func:`eager` function's disabled twin, also bound in its place in dtp's modules
    and classes: a region tracing a call to the wrapper would meet the break inside the
    wrapper's frame and count it twice (measured: "2 × Skip calling all_reduce" for one
    call site in ``dtp train --compile --debug``); a call to the twin is one break."""
    with _twins_lock:
        if _twins_made[0] == len(_eager_fns):  # every compiled step comes here: scan once
            return
        twins: dict[int, Callable[..., Any]] = {}
        for fn, twin, call in _eager_fns:
            if twin[0] is None:
                twin[0] = torch.compiler.disable(fn)
            twins[id(call)] = twin[0]
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "dtp" or name.startswith("dtp.")):
                continue
            spaces = [module] + [v for v in vars(module).values()
                                 if isinstance(v, type) and v.__module__ == name]  # classes: CommHandle.wait
            for space in spaces:
                for attr, value in list(vars(space).items()):
                    if id(value) in twins:
                        setattr(space, attr, twins[id(value)])
        _twins_made[0] = len(_eager_fns)  # last: a failure above is tried again next time


class Watch:
    """The graphs compiled and graph breaks met since it was made (dynamo's counters
    are process-wide; this is their difference)."""

    def __init__(self) -> None:
        self._graphs, self._breaks = _graphs(), _breaks()

    def metrics(self) -> dict[str, int]:
        """``compile_graphs`` (new graphs: after the first step, recompiles) and
        ``compile_breaks`` (graph breaks met while tracing them)."""
        breaks = _breaks()
        return {"compile_graphs": _graphs() - self._graphs,
                "compile_breaks": sum(breaks.values()) - sum(self._breaks.values())}


@contextlib.contextmanager
def compiling(options: bool | str | CompileOptions | None) -> Iterator[Watch]:
    """Compile the regions met inside (``None``/``False``: eager, as outside)."""
    previous = active()
    _state.options = options_of(options)
    if _state.options is not None:
        _make_twins()
    try:
        yield Watch()
    finally:
        _state.options = previous


@contextlib.contextmanager
def retaining_graph() -> Iterator[None]:
    """Regions compiled inside may have their backward run twice (zero bubble's ``I`` keeps
    the graph for ``W``: :mod:`dtp.strategies.pipeline_split`). AOT autograd otherwise
    lets a compiled backward reuse ("donate") its saved tensors, and then refuses a second
    run with a ``RuntimeError`` — on the ranks that compiled such a graph (with dynamic
    shapes, after a change of batch or microbatches), while their pipeline peers wait.
    Inside, regions are compiled donating nothing (their own cache entries) and the
    backward's check is off (:func:`dtp.core._torch.no_donated_buffers`, while compiling).

    >>> with retaining_graph():
    ...     pass
    """
    _retaining[0] += 1
    try:
        with no_donated_buffers() if active() is not None else contextlib.nullcontext():
            yield
    finally:
        _retaining[0] -= 1


def region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a compiled region when :func:`compiling` is on (else ``fn``).

    Ops build their local functions per call (closures over the call's values), so a
    region is not ``torch.compile(fn)`` (≈170 µs to build each time) but one compiled
    trampoline per code object, cached: dynamo inlines ``fn`` and guards on its code
    and its closure, so a new closure of the same code reuses the graph. A builtin
    (``torch.matmul``) is returned as is: one kernel gains nothing from compiling; so is a
    ``functools.partial``, how an op marks a body that communicates (async tp's rings).
    """
    options = active()
    if options is None or not isinstance(fn, types.FunctionType):
        return fn
    key = (fn.__code__, options, _retaining[0] > 0)
    compiled = _cache.get(key)
    if compiled is None:
        # Its own code object (named after fn, so a break or recompile names the region):
        # dynamo's cache and recompile limit are per code object.
        code = _call.__code__.replace(co_name=f"dtp_region_{fn.__code__.co_name}")
        trampoline = types.FunctionType(code, _call.__globals__, code.co_name)
        compiled = _cache[key] = torch.compile(trampoline, backend=options.backend, dynamic=options.dynamic)
    return functools.partial(compiled, fn)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _graphs() -> int:
    if "torch._dynamo" not in sys.modules:  # nothing has compiled (see eager())
        return 0
    return int(dynamo_counters()["stats"].get("unique_graphs", 0))


def _breaks() -> dict[str, int]:
    if "torch._dynamo" not in sys.modules:
        return {}
    return dict(dynamo_counters()["graph_break"])


def report(recompiles: int | None = None) -> str:
    """The graphs compiled and graph breaks met so far in this process: each break's
    reason (dynamo's explanation) with its count; ``recompiles``
    (the graphs the steps after the first compiled) is added when given.

    >>> report(recompiles=0).splitlines()[0].startswith("compiled graphs:")
    True
    """
    graphs, breaks = _graphs(), Counter()
    for reason, n in _breaks().items():
        breaks[_reason(reason)] += n
    lines = [f"compiled graphs: {graphs}" + (f", recompiles after the first step: {recompiles}"
                                             if recompiles is not None else ""),
             f"graph breaks: {sum(breaks.values())}"]
    lines += [f"  {n} × {reason}" for reason, n in breaks.most_common()]
    return "\n".join(lines)


def _reason(text: str) -> str:
    """One line of a break's reason: dynamo's explanation (else its first line), without
    the addresses that make each function's break a reason of its own."""
    lines = [ln.strip() for ln in text.strip().splitlines()]
    why = next((ln.removeprefix("Explanation:").strip() for ln in lines if ln.startswith("Explanation:")), "")
    return re.sub(r" at 0x[0-9a-f]+", "", why or lines[0])[:200]
