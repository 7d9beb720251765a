"""Cross-rank consistency guard: the ranks agree on what they were given before they compute.

Every rank runs the same program on what should be the same inputs. When they are not
(a batch of another shape on one rank, ``microbatches`` given differently, parameters
that differ where they should be replicas), the collectives still pair up and the run
trains on, silently wrong; when a check fails on one rank only, the others wait in the
next collective until the process-group timeout. The guard closes both:

* **when**: once per state (:meth:`dtp.TrainState.create`) and once per new batch
  signature of a state (the first :func:`dtp.shard_batch` and the first :func:`dtp.train_step` with given
  batch keys, shapes, dtypes, placements and step options); a step whose signature the ranks already
  agreed on costs a set lookup. ``DTP_CHECKS=2`` checks every step.
* **what**: one all-gather over the whole mesh (tag ``guard …``) of a fixed record of
  :data:`WIDTH` int64 (560 bytes per rank): an ok flag (this rank's own validation
  passed), a hash of the fields every rank must agree on (shapes, dtypes and placements
  of the batch or parameters, step options, layout rules and options, mesh, step), the
  min/max of the token/target ids (:data:`ID_KEYS`; a target of -100 is masked, not an
  id: :func:`id_range`), and 64 checksum slots, one per set of mesh axes: a tensor split over axes A (a batch shard; a parameter at create, whole,
  A empty; the global batch given to shard_batch, A empty) lands in slot A and is compared between the ranks with equal coordinates on
  A, the ones that must hold identical values.
* **on disagreement** (a failed flag, hashes or checksums that differ): a second
  exchange of every rank's fields and messages, then every rank raises the same error:
  a rank's own validation error (its type and message), or a ``ValueError`` naming the
  field, the ranks and their values. Ids outside ``[0, vocab)`` (the size of the
  parameters' ``vocab`` logical axis) are a ``ValueError`` on every rank from the record.

The exchange goes to its own log, :data:`log` (``comm_log(isolated=True)``), not to the
logs around it: it is a check, not a step's traffic, so a step's comm records and
``comm_bytes`` stay what the algorithm moves.

``DTP_CHECKS=0`` (read at each call) turns the guard off, for benchmarks, with a one-time
warning; each rank's own validation still raises, on that rank alone. With one rank, or
under :func:`dtp.testing.simulate` (one program plays every rank), there is nothing to
agree on and nothing is exchanged. What it cannot see: a rank whose inputs change alone
while the others' stay on a signature already agreed (it exchanges, they do not); set
``DTP_CHECKS=2`` while debugging such a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core import comm
from ..core._rules import IGNORE_INDEX
from ..core.comm import CommLog
from ..core.mesh.devices import all_coordinates, axis_names, axis_sizes, flatten_axes
from ..core.spec import spec_of

__all__ = ["ENV", "ID_KEYS", "WIDTH", "Agreements", "Fingerprint", "mode", "log", "agree", "check_state",
           "check_step", "check_ids", "id_range", "checksum", "fail_together", "active"]

ENV = "DTP_CHECKS"
ID_KEYS = ("tokens", "targets")  # batch entries that hold vocabulary ids
SLOTS = 64  # checksum slots: one per set of (at most 6) mesh axes
_HEAD = 2 + 2 * len(ID_KEYS)  # ok, fields hash, (min, max) per id key
WIDTH = _HEAD + SLOTS
_NO_MIN, _NO_MAX = 2**63 - 1, -(2**63)
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}

log = CommLog()  # every exchange the guard made in this process
_warned = False


@dataclass(eq=False)
class Agreements:
    """What a state's ranks agreed on; grows as steps agree on new batch signatures
    (carried from state to state, like the state's static fields)."""

    signatures: set = field(default_factory=set)
    vocab: int | None = None  # size of the parameters' "vocab" logical axis
    param_dtype: torch.dtype | None = None  # the parameters' floating dtype, when they share one


@dataclass
class Fingerprint:
    """One rank's view: fields every rank must agree on, checksums of tensors that ranks
    with equal coordinates on ``mask``'s axes must hold alike, local id ranges, and this
    rank's own validation error (``(type name, message)``) if any."""

    fields: dict[str, str] = field(default_factory=dict)
    replicas: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (axes mask, checksum)
    ids: dict[str, tuple[int, int]] = field(default_factory=dict)  # id key -> (min, max) here
    error: tuple[str, str] | None = None


def mode() -> int:
    """``DTP_CHECKS`` now: 0 off (warned once), 1 once per state and batch signature
    (the default), 2 every step."""
    global _warned
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("0", "false", "off", "no"):
        if not _warned:
            _warned = True
            warnings.warn(f"dtp: {ENV}={value}: the cross-rank consistency guard is off; inputs that differ "
                          "between ranks and checks that fail on one rank only are not caught", RuntimeWarning,
                          stacklevel=3)
        return 0
    return 2 if value in ("2", "always", "every") else 1


def active(mesh: DeviceMesh) -> bool:
    """Whether the guard's exchanges run on ``mesh``: more than one rank, and a group that
    communicates (not torch's fake one)."""
    return _active(mesh)


def _active(mesh: DeviceMesh) -> bool:
    if mesh.size() == 1:
        return False
    return not (dist.is_initialized() and dist.get_backend() == "fake")


def _hash(obj: Any) -> int:
    digest = hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(x: torch.Tensor) -> int:
    """A position-weighted sum of ``x``'s bits (int64, wrapping): equal tensors give
    equal sums on every rank, different ones almost surely not. NaNs compare as bits."""
    x = (x.to_local() if isinstance(x, DTensor) else x).detach().contiguous().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    bits = x.view(_INT_OF_SIZE[x.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    step = 1 << 22
    for start in range(0, bits.numel(), step):
        chunk = bits[start:start + step].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=x.device) * 0x9E3779B1 + 1
        total += (chunk * weights).sum()
    return int(total) ^ (bits.numel() << 1)


def _mask(x: torch.Tensor, mesh: DeviceMesh) -> int:
    """Bit i set when ``x`` is split over ``mesh``'s dim i (a plain tensor: none). By
    name: ``x`` may live on a sub-mesh (a pipeline stage's mesh lacks ``pp``)."""
    if not isinstance(x, DTensor):
        return 0
    names = list(axis_names(mesh))
    own = x.device_mesh.mesh_dim_names or ()
    return sum(1 << names.index(own[i]) for i, p in enumerate(x.placements) if p.is_shard() and own[i] in names)


def describe(x: object) -> str:
    """Shape, dtype and placement of a tensor, for a field."""
    if not isinstance(x, torch.Tensor):
        return f"not a tensor ({type(x).__name__})"
    where = f" {spec_of(x)}" if isinstance(x, DTensor) else ""
    return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}{where}"


def describe_layout(layout: Any) -> str:
    rules = {k: sorted((a, list(v)) for a, v in getattr(layout, k).items()) for k in ("params", "activations")}
    return json.dumps([rules, repr(layout.megatron), repr(layout.context), repr(layout.zero)])


def _common_fields(mesh: DeviceMesh, layout: Any) -> dict[str, str]:
    return {"mesh": f"{mesh.device_type} {axis_sizes(mesh)} ranks {mesh.mesh.tolist()}",
            "layout": f"{layout.name or 'custom'} #{_hash(describe_layout(layout)) & 0xFFFFFFFF:08x}"}


def id_range(key: str, ids: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of the vocabulary ids in ``batch[key]`` (``None``: none). In
    ``targets`` :data:`~dtp.core._rules.IGNORE_INDEX` is no id (a masked target), so it is left
    out; any other negative still shows as the minimum.

    >>> id_range("targets", torch.tensor([5, -100, 7])), id_range("tokens", torch.tensor([5, -100]))
    ((5, 7), (-100, 5))
    """
    ids = ids.detach()
    if key == "targets":
        ids = ids[ids != IGNORE_INDEX]
    if not ids.numel():
        return None
    lo, hi = torch.aminmax(ids)
    return int(lo), int(hi)


def check_ids(key: str, lo: int, hi: int, vocab: int | None, what: str, where: str = "") -> None:
    """``ValueError`` when ids ``[lo, hi]`` of ``batch[key]`` leave ``[0, vocab)``."""
    if vocab is not None and lo <= hi and (lo < 0 or hi >= vocab):
        raise ValueError(f"{what}: batch[{key!r}] holds ids from {lo} to {hi}{where}, outside the vocabulary "
                         f"[0, {vocab}) (the size of the parameters' 'vocab' axis); fix the data or the model's "
                         "vocab_size")


def _error(e: BaseException | None) -> tuple[str, str] | None:
    return None if e is None else (type(e).__name__, str(e))


def check_state(mesh: DeviceMesh, layout: Any, params: Mapping[str, object],
                axes: Mapping[str, object], error: BaseException | None) -> None:
    """At ``TrainState.create``: every rank was given the same mesh, layout, and global
    parameters (shapes, dtypes, logical axes, values); then ``error`` (this rank's
    validation) is raised on every rank if any rank has one."""
    if not _active(mesh) or mode() == 0:
        if error is not None:
            raise error
        return
    fp = Fingerprint(_common_fields(mesh, layout), error=_error(error))
    for path, x in params.items():
        fp.fields[f"param {path}"] = f"{describe(x)} axes {axes.get(path)!r}"
        if isinstance(x, torch.Tensor):
            fp.replicas[f"param {path} (the global value given to TrainState.create)"] = (0, checksum(x))
    agree("TrainState.create", mesh, fp)
    if error is not None:  # agree() raised it on every rank already; kept for clarity
        raise error


def check_together(what: str, mesh: DeviceMesh, fields: Mapping[str, str], error: BaseException | None) -> None:
    """The ranks agree on ``fields`` (they were given the same checkpoint, the same
    options …), then ``error`` (this rank's own check) is raised on every rank if any
    rank has one. One small all-gather; collective: call on every rank."""
    if not _active(mesh) or mode() == 0:
        if error is not None:
            raise error
        return
    agree(what, mesh, Fingerprint(dict(fields), error=_error(error)))
    if error is not None:
        raise error


def fail_together(what: str, mesh: DeviceMesh, error: BaseException | None,
                  raise_as: type[Exception] = RuntimeError) -> None:
    """A barrier that carries a failure: when any rank passes an ``error`` (a disk full on
    one rank's write), every rank raises ``raise_as`` with its message; else all go on.
    Unlike :func:`check_together` also under ``DTP_CHECKS=0``: this is no consistency check
    but what keeps the peers of a failed rank from waiting for it until the timeout. One
    small all-gather; collective: call on every rank."""
    if not _active(mesh):
        if error is not None:
            raise error
        return
    try:
        agree(what, mesh, Fingerprint({}, error=_error(error)))
    except (ValueError, TypeError, RuntimeError) as e:  # agree() words it alike on every rank
        # Less agree()'s note of which ranks failed "this check": a failure's message names its rank.
        raise raise_as(re.sub(r" \[[^\[]*; every rank raises this error\]$", "", str(e))) from None


def signature(batch: Mapping[str, object], options: Mapping[str, object]) -> tuple:
    """What makes a step new to the guard: batch keys, shapes, dtypes, placements, options."""
    parts = []
    for k, v in batch.items():
        if isinstance(v, DTensor):
            parts.append((k, tuple(v.shape), v.dtype, v.placements, id(v.device_mesh)))
        elif isinstance(v, torch.Tensor):
            parts.append((k, tuple(v.shape), v.dtype))
        else:
            parts.append((k, type(v).__name__))
    return tuple(parts), tuple(sorted((k, repr(v)) for k, v in options.items()))


def check_step(agreed: Agreements, mesh: DeviceMesh, layout: Any, step: int, batch: Mapping[str, object],
               options: Mapping[str, object], error: BaseException | None, what: str = "train_step") -> None:
    """At ``train_step`` and ``shard_batch`` (``what``): the first call with a batch
    signature (every call with ``DTP_CHECKS=2``) exchanges the fingerprint; ``error``
    (this rank's validation) is raised on every rank if any rank has one."""
    if not _active(mesh):
        if error is not None:
            raise error
        return
    level = mode()
    sig = (what, signature(batch, options)) if level else None
    if level == 0 or (level == 1 and error is None and sig in agreed.signatures):
        if error is not None:
            raise error
        return
    fp = Fingerprint(_common_fields(mesh, layout), error=_error(error))
    fp.fields["step"] = str(step)
    fp.fields.update({f"option {k}": repr(v) for k, v in options.items()})
    for k, v in batch.items():
        fp.fields[f"batch[{k!r}]"] = describe(v)
        if isinstance(v, torch.Tensor):
            fp.replicas[f"batch[{k!r}]"] = (_mask(v, mesh), checksum(v))
            local = v.to_local() if isinstance(v, DTensor) else v
            if k in ID_KEYS and local.numel() and not (local.is_floating_point() or local.is_complex()):
                found = id_range(k, local)
                if found is not None:
                    fp.ids[k] = found
    agree(what, mesh, fp, vocab=agreed.vocab)
    if error is not None:
        raise error
    agreed.signatures.add(sig)


def _view(mesh: DeviceMesh) -> tuple[DeviceMesh, str]:
    names = axis_names(mesh)
    flat = flatten_axes(mesh, names, "guard") if len(names) > 1 else mesh
    return flat, axis_names(flat)[0]


def _record(fp: Fingerprint) -> torch.Tensor:
    rec = torch.zeros(WIDTH, dtype=torch.int64)
    rec[0] = int(fp.error is None)
    rec[1] = _hash(fp.fields)
    for i, key in enumerate(ID_KEYS):
        rec[2 + 2 * i], rec[3 + 2 * i] = fp.ids.get(key, (_NO_MIN, _NO_MAX))
    slots: dict[int, list] = {}
    for name, (mask, value) in sorted(fp.replicas.items()):
        if mask < SLOTS:  # meshes of more than 6 axes: the extra combinations go unchecked
            slots.setdefault(mask, []).append((name, value))
    for mask, items in slots.items():
        rec[_HEAD + mask] = _hash(items)
    return rec


def _gather(mesh: DeviceMesh, x: torch.Tensor, what: str) -> torch.Tensor:
    flat, axis = _view(mesh)
    with comm.comm_log(isolated=True) as mine:
        out = comm.all_gather(x.to(mesh.device_type), flat, axis, tag=f"guard {what}")
    log.records.extend(mine.records)
    return out.cpu()


def _groups(coords: list[dict[str, int]], axes: list[str]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for k, c in enumerate(coords):
        groups.setdefault(tuple(c[a] for a in axes), []).append(k)
    return groups


def _ranks(ks: list[int], ranks: list[int]) -> str:
    rs = [ranks[k] for k in ks]
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def agree(what: str, mesh: DeviceMesh, fp: Fingerprint, *, vocab: int | None = None) -> None:
    """Exchange ``fp`` over the whole mesh; raise the same error on every rank when the
    ranks disagree (or one failed its own validation). Collective: call on every rank."""
    names = list(axis_names(mesh))
    ranks = [int(r) for r in mesh.mesh.reshape(-1).tolist()]
    coords, n = all_coordinates(mesh), len(ranks)
    table = _gather(mesh, _record(fp), what).view(n, WIDTH)
    bad = not bool(table[:, 0].all()) or len(set(table[:, 1].tolist())) > 1
    for mask in range(min(SLOTS, 1 << len(names))):
        axes = [a for i, a in enumerate(names) if mask >> i & 1]
        for ks in _groups(coords, axes).values():
            bad = bad or len(set(table[ks, _HEAD + mask].tolist())) > 1
    if bad:
        _disagreement(what, mesh, fp, names, coords, ranks)
    for i, key in enumerate(ID_KEYS):
        lo, hi = int(table[:, 2 + 2 * i].min()), int(table[:, 3 + 2 * i].max())
        if vocab is not None and lo <= hi and (lo < 0 or hi >= vocab):
            out = [k for k in range(n) if table[k, 2 + 2 * i] < 0 or table[k, 3 + 2 * i] >= vocab]
            check_ids(key, lo, hi, vocab, what, f" (on {_ranks(out, ranks)})")


def _disagreement(what: str, mesh: DeviceMesh, fp: Fingerprint, names: list[str], coords: list[dict[str, int]],
                  ranks: list[int]) -> None:
    """The second exchange (only on a disagreement the first one showed to every rank):
    every rank's fields, checksums and error, so every rank words the same error."""
    blob = json.dumps({"fields": fp.fields, "replicas": fp.replicas, "error": fp.error}).encode()
    lengths = _gather(mesh, torch.tensor([len(blob)], dtype=torch.int64), what + " details")
    width = int(lengths.max())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    raw = _gather(mesh, mine, what + " details").view(len(ranks), width)
    views = [json.loads(bytes(raw[k, :int(lengths[k])].tolist()).decode()) for k in range(len(ranks))]
    failed = [k for k, v in enumerate(views) if v["error"] is not None]
    if failed:
        kind, message = views[failed[0]]["error"]
        distinct = {tuple(views[k]["error"]) for k in failed}
        if len(failed) < len(views) or len(distinct) > 1:
            message += (f" [{_ranks(failed, ranks)} failed this check, "
                        f"{'the other ranks passed' if len(failed) < len(views) else 'with different messages'}; "
                        "every rank raises this error]")
        raise _ERRORS.get(kind, RuntimeError)(message)

    keys = list(dict.fromkeys(k for v in views for k in v["fields"]))
    for key in keys:
        values = [v["fields"].get(key, "<absent>") for v in views]
        if len(set(values)) > 1:
            raise ValueError(f"{what}: the ranks disagree on {key} — {_by_value(range(len(views)), values, ranks)}. Every rank must pass "
                             "the same (global) values")
    for name in list(dict.fromkeys(k for v in views for k in v["replicas"])):
        masks = {tuple(v["replicas"][name])[0] for v in views if name in v["replicas"]}
        for mask in masks:
            axes = [a for i, a in enumerate(names) if mask >> i & 1]
            for ks in _groups(coords, axes).values():
                values = [views[k]["replicas"].get(name, [mask, None])[1] for k in ks]
                if len(set(values)) > 1:
                    held = (f"split over {', '.join(axes)}: ranks with equal coordinates on it hold the same shard"
                            if axes else "it must be identical on every rank")
                    sums = _by_value(ks, values, ranks, _checksum_text)
                    raise ValueError(f"{what}: {name} differs between {_ranks(ks, ranks)} ({held}) — {sums}")
    raise RuntimeError(f"{what}: the ranks' fingerprints differ, but no field or checksum does (a hash collision?)")


def _by_value(ks: Sequence[int], values: list[object], ranks: list[int],
              show: Callable[[object], str] = str) -> str:
    """``"ranks [0, 2]: a; rank 1: b"``: the mesh positions ``ks`` grouped by their value."""
    groups: dict[object, list[int]] = {}
    for k, v in zip(ks, values):
        groups.setdefault(v, []).append(k)
    return "; ".join(f"{_ranks(g, ranks)}: {show(v)}" for v, g in groups.items())


def _checksum_text(v: object) -> str:
    return f"checksum {v & (2**64 - 1):#018x}" if isinstance(v, int) else "<absent>"
