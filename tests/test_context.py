"""Context-parallel attention (dtp.ops.context) on CPU gloo ranks, fp64.

Every algorithm is checked against single-device SDPA (output and dQ/dK/dV, rel 1e-10,
after un-permuting the cp order), its comm log against the byte formulas (exact record
lists: nothing more may move), the ring's transfers against the compute they overlap,
zigzag balance from the blocks actually computed, and every validation error (raised on
all ranks, before any collective).

To keep the file fast, all world-4 cases run in one call to the rank pool (a module
fixture) and the tests read their case's result; a case that fails reports its own error.
"""

from __future__ import annotations

import math
import re
import traceback

import pytest
import torch

from dtp.ops.blockwise import zigzag_permutation
from dtp.testing import causal_work, run

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12


# ------------------------------------------------------------------ the rank side


def _inputs(case: dict):
    g = torch.Generator().manual_seed(case.get("seed", 0))
    b, S, d, hq, hkv = case.get("b", 2), case["S"], case.get("d", 4), case["hq"], case["hkv"]
    q = torch.randn(b, hq, S, d, dtype=F64, generator=g)
    k = torch.randn(b, hkv, S, d, dtype=F64, generator=g)
    v = torch.randn(b, hkv, S, d, dtype=F64, generator=g)
    w = torch.randn(b, hq, S, d, dtype=F64, generator=g)  # upstream gradient
    return q, k, v, w


def _attend(case: dict) -> dict:
    """Run one case on this rank; returns errors (not raised: every rank must finish the
    same collectives), the comm records of forward and backward, and the compute trace."""
    import torch.nn.functional as F

    import dtp
    from dtp import P
    from dtp.core._torch import local_tensor
    from dtp.ops import context as C
    from dtp.ops.blockwise import from_cp_order, to_cp_order
    from dtp.redistribute import to_local

    mesh = dtp.make_mesh(**case["axes"])
    seq = case.get("seq", "cp")
    seq_axes = (seq,) if isinstance(seq, str) else tuple(seq)
    cp = math.prod(dict(case["axes"])[a] for a in seq_axes)
    lb, causal = case["lb"], case["causal"]
    q, k, v, w = _inputs(case)
    dtype = getattr(torch, case.get("dtype", "float64"))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, enable_gqa=True)
    (ref * w).sum().backward()

    spec = P(case.get("batch"), case.get("heads"), seq)
    dq, dk, dv = (dtp.shard(to_cp_order(t.to(dtype), 2, cp, lb), mesh, spec) for t in (q, k, v))
    if case.get("strided"):  # local shards laid out (b, s, h, d), as a model's q.transpose(1, 2) gives
        dq, dk, dv = (dtp.from_local(to_local(t).transpose(1, 2).contiguous().transpose(1, 2), mesh, spec,
                                     tuple(t.shape)) for t in (dq, dk, dv))
        assert not to_local(dq).is_contiguous()
    dq, dk, dv = (t.requires_grad_() for t in (dq, dk, dv))
    wl = to_local(dtp.shard(to_cp_order(w.to(dtype), 2, cp, lb), mesh, spec))
    with C.trace_compute() as events:
        with dtp.comm_log() as fwd:
            out = C.context_attention(dq, dk, dv, algo=case["algo"], causal=causal, load_balance=lb, **case.get("kw", {}))
        with dtp.comm_log() as bwd:
            (to_local(out) * wl).sum().backward()
    got = {name: from_cp_order(t.full_tensor(), 2, cp, lb).detach()
           for name, t in (("out", out), ("dq", dq.grad), ("dk", dk.grad), ("dv", dv.grad))}
    errors = []
    for name, expected in (("out", ref), ("dq", qr.grad), ("dk", kr.grad), ("dv", vr.grad)):
        if got[name].dtype != dtype:
            errors.append(f"{name}: dtype {got[name].dtype}, expected {dtype}")
        elif dtype == F64:
            try:
                torch.testing.assert_close(got[name], expected.detach(), rtol=RTOL, atol=ATOL)
            except AssertionError as e:
                errors.append(f"{name}: {e}")
        else:  # low precision against the fp64 reference: max error relative to the max value
            err = ((got[name].double() - expected).abs().max() / expected.abs().max()).item()
            if err > case["tol"]:
                errors.append(f"{name}: relative error {err:.2e} > {case['tol']}")
    recs = lambda log: [dict(kind=r.kind, axis=r.axis, bytes=r.bytes, tag=r.tag, issued=r.issued,
                             completed=r.completed, dtype=str(r.dtype)) for r in log.records]
    return dict(
        errors=errors, fwd=recs(fwd), bwd=recs(bwd),
        events=[dict(e, tasks=[(t.q_slice.start, t.q_slice.stop, t.k_slice.start, t.k_slice.stop, t.mask)
                               for t in e["tasks"]]) for e in events],
        q_local=local_tensor(dq).nbytes, k_local=local_tensor(dk).nbytes,
        L=local_tensor(dq).shape[2], rank=dtp.mesh.axis_coordinate(mesh, seq_axes[0]),
    )


def _attend_all(cases: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for name, case in cases.items():
        try:
            out[name] = _attend(case)
        except Exception:  # validation bugs raise on every rank alike: report per case
            out[name] = dict(errors=[traceback.format_exc()])
    return out


# ------------------------------------------------------------------------ cases

CP4, DP2CP2, CP2TP2 = {"cp": 4}, {"dp": 2, "cp": 2}, {"cp": 2, "tp": 2}
ZZ, NONE = "zigzag", None

CASES4 = {
    "ring-zigzag-causal-mha-cp4": dict(algo="ring", axes=CP4, lb=ZZ, causal=True, hq=2, hkv=2, S=16,
                                       kw={"head_chunks": 2}),
    "ring-none-causal-gqa-cp4": dict(algo="ring", axes=CP4, lb=NONE, causal=True, hq=4, hkv=2, S=16),
    "ring-zigzag-full-gqa-cp4": dict(algo="ring", axes=CP4, lb=ZZ, causal=False, hq=4, hkv=1, S=16),
    "ring-bf16-zigzag-causal-gqa-cp4": dict(algo="ring", axes=CP4, lb=ZZ, causal=True, hq=4, hkv=2, S=16,
                                            dtype="bfloat16", tol=2e-2, kw={"head_chunks": 2}),
    "ulysses-bf16-strided-zigzag-causal-gqa-cp2": dict(algo="ulysses", axes=DP2CP2, lb=ZZ, causal=True, hq=8,
                                                       hkv=4, S=16, dtype="bfloat16", tol=2e-2, strided=True,
                                                       kw={"head_chunks": 2}),
    "hybrid-bf16-strided-u2-zigzag-causal-gqa-cp4": dict(algo="hybrid", axes=CP4, lb=ZZ, causal=True, hq=8, hkv=4,
                                                         S=16, dtype="bfloat16", tol=2e-2, strided=True,
                                                         kw={"ulysses_degree": 2, "head_chunks": 2}),
    "ring-strided-none-causal-gqa-cp4": dict(algo="ring", axes=CP4, lb=NONE, causal=True, hq=4, hkv=2, S=16,
                                             strided=True, kw={"head_chunks": 2}),
    "ring-none-full-mha-dp2cp2": dict(algo="ring", axes=DP2CP2, lb=NONE, causal=False, hq=2, hkv=2, S=8, batch="dp"),
    "ring-zigzag-causal-gqa-cp2tp2": dict(algo="ring", axes=CP2TP2, lb=ZZ, causal=True, hq=4, hkv=2, S=8, heads="tp"),
    "ring-size1": dict(algo="ring", axes={"dp": 2, "cp": 1, "tp": 2}, lb=ZZ, causal=True, hq=2, hkv=2, S=8,
                       batch="dp", heads="tp"),
    "ulysses-zigzag-causal-mha-cp4": dict(algo="ulysses", axes=CP4, lb=ZZ, causal=True, hq=4, hkv=4, S=16),
    "ulysses-none-causal-gqarepeat-cp4": dict(algo="ulysses", axes=CP4, lb=NONE, causal=True, hq=8, hkv=2, S=8),
    "ulysses-zigzag-full-gqa-dp2cp2": dict(algo="ulysses", axes=DP2CP2, lb=ZZ, causal=False, hq=4, hkv=2, S=8,
                                           batch="dp"),
    "ulysses-zigzag-causal-gqarepeat-cp2tp2": dict(algo="ulysses", axes=CP2TP2, lb=ZZ, causal=True, hq=4, hkv=2,
                                                   S=8, heads="tp"),
    "double_ring-w2-zigzag-causal-gqa-cp4": dict(algo="double_ring", axes=CP4, lb=ZZ, causal=True, hq=4, hkv=2,
                                                 S=16, kw={"window": 2, "head_chunks": 2}),
    # (window 1 would be the plain ring, which double_ring refuses: dtp.layouts.check_window)
    "double_ring-w2-none-causal-mha-cp4": dict(algo="double_ring", axes=CP4, lb=NONE, causal=True, hq=2, hkv=2,
                                               S=8, kw={"window": 2, "head_chunks": 2}),
    "hybrid-u2-zigzag-causal-gqa-cp4": dict(algo="hybrid", axes=CP4, lb=ZZ, causal=True, hq=4, hkv=2, S=16,
                                            kw={"ulysses_degree": 2}),
    "hybrid-u2-none-causal-gqarepeat-cp4": dict(algo="hybrid", axes=CP4, lb=NONE, causal=True, hq=4, hkv=1, S=8,
                                                kw={"ulysses_degree": 2}),
    "double_ring-w2-zigzag-full-gqa-cp4": dict(algo="double_ring", axes=CP4, lb=ZZ, causal=False, hq=4, hkv=2,
                                               S=16, kw={"window": 2}),
    "hybrid-u2-none-full-mha-cp4": dict(algo="hybrid", axes=CP4, lb=NONE, causal=False, hq=4, hkv=4, S=8,
                                        kw={"ulysses_degree": 2, "head_chunks": 2}),
    "ring-chunks1-zigzag-causal-mha-cp4": dict(algo="ring", axes=CP4, lb=ZZ, causal=True, hq=2, hkv=2, S=16,
                                               kw={"head_chunks": 1}),
    "ulysses-chunked-zigzag-causal-gqa-cp2": dict(algo="ulysses", axes={"dp": 2, "cp": 2}, lb=ZZ, causal=True,
                                                  hq=8, hkv=4, S=8, kw={"head_chunks": 2}),
    "hybrid-chunks1-u2-zigzag-causal-mha-cp4": dict(algo="hybrid", axes=CP4, lb=ZZ, causal=True, hq=4, hkv=4,
                                                    S=16, kw={"ulysses_degree": 2, "head_chunks": 1}),
    "hybrid-axes-zigzag-causal-mha": dict(algo="hybrid", axes={"cpr": 2, "cpu": 2}, lb=ZZ, causal=True, hq=2,
                                          hkv=2, S=16, seq=("cpr", "cpu"), kw={"axis": ("cpr", "cpu")}),
}

CASES8 = {
    "ring-zigzag-causal-gqa-cp8": dict(algo="ring", axes={"cp": 8}, lb=ZZ, causal=True, hq=4, hkv=2, S=32, b=1,
                                       kw={"head_chunks": 2}),
    "hybrid-u2w2-zigzag-causal-gqa-cp8": dict(algo="hybrid", axes={"cp": 8}, lb=ZZ, causal=True, hq=4, hkv=2,
                                              S=32, b=1, kw={"ulysses_degree": 2, "window": 2}),
    # All cp=8 cases share the one world-8 pool run below; kept small (b=1, S=16).
    "ulysses-zigzag-causal-gqarepeat-cp8": dict(algo="ulysses", axes={"cp": 8}, lb=ZZ, causal=True, hq=8, hkv=2,
                                                S=16, b=1),
    "double_ring-w4-zigzag-causal-gqa-cp8": dict(algo="double_ring", axes={"cp": 8}, lb=ZZ, causal=True, hq=4,
                                                 hkv=2, S=16, b=1, kw={"window": 4, "head_chunks": 2}),
    "double_ring-w2-none-full-mha-cp8": dict(algo="double_ring", axes={"cp": 8}, lb=NONE, causal=False, hq=2,
                                             hkv=2, S=16, b=1, kw={"window": 2, "head_chunks": 2}),
    "hybrid-u4-zigzag-causal-gqarepeat-cp8": dict(algo="hybrid", axes={"cp": 8}, lb=ZZ, causal=True, hq=4, hkv=2,
                                                  S=16, b=1, kw={"ulysses_degree": 4}),
}


@pytest.fixture(scope="module")
def results4() -> list[dict[str, dict]]:
    return run(_attend_all, CASES4, world_size=4)


@pytest.fixture(scope="module")
def results8() -> list[dict[str, dict]]:
    return run(_attend_all, CASES8, world_size=8)


def _ok(results: list[dict[str, dict]], name: str) -> list[dict]:
    per_rank = [r[name] for r in results]
    for rank, res in enumerate(per_rank):
        assert not res["errors"], f"{name} rank {rank}:\n" + "\n".join(res["errors"])
    return per_rank


def _chunks(name: str, cases: dict[str, dict]) -> int:
    """Head chunks the case runs in: its ``head_chunks``, else 1 (dtp's default for
    tensors this small: no chunk's K+V may drop below 1 MiB, see test_default_chunks)."""
    return cases[name].get("kw", {}).get("head_chunks") or 1


# ------------------------------------------------------------------------ parity


@pytest.mark.parametrize("name", list(CASES4))
def test_matches_sdpa(results4, name):
    _ok(results4, name)


@pytest.mark.slow  # a world of 8 (~35 s on 2 cores, the pool's start included); cp4 is the default run's
@pytest.mark.parametrize("name", list(CASES8))
def test_matches_sdpa_cp8(results8, name):
    per_rank = _ok(results8, name)
    c = _chunks(name, CASES8)
    if name.startswith("ring"):
        _check_ring_bytes(per_rank, n=8, chunks=c)
    elif name.startswith("ulysses"):
        _check_ulysses_bytes(per_rank, n=8, repeat=4, chunks=c)  # 2 kv heads repeated up to cp = 8
    elif name.startswith("double_ring"):
        _check_double_ring_bytes(per_rank, n=8, w=CASES8[name]["kw"]["window"], chunks=c)
    elif name == "hybrid-u4-zigzag-causal-gqarepeat-cp8":
        _check_hybrid_bytes(per_rank, u=4, R=2, repeat=2, chunks=c)  # 2 kv heads repeated up to u = 4


# ---------------------------------------------------------------- comm volume


def _summary(recs: list[dict]) -> list[tuple[str, str, int]]:
    return [(r["kind"], r["axis"], r["bytes"]) for r in recs]


def _check_ring_bytes(per_rank: list[dict], n: int, axis: str = "cp", chunks: int = 1) -> None:
    for res in per_rank:
        kv = 2 * res["k_local"] // chunks  # one K+V buffer of one head chunk per step
        assert _summary(res["fwd"]) == [("send_recv", axis, kv)] * (n - 1) * chunks, res["fwd"]
        # (n-1)/n of the global K and V bytes (per cp group) leave each rank, whatever the chunks.
        assert sum(r["bytes"] for r in res["fwd"]) == (n - 1) * 2 * res["k_local"]
        bwd = _summary(res["bwd"])
        # n-1 K/V + n dK/dV (fp64) per chunk
        assert sorted(bwd) == sorted([("send_recv", axis, kv)] * (2 * n - 1) * chunks), bwd
        tags = [r["tag"] for r in res["bwd"]]
        assert sum(t.startswith("ring bwd dkv") for t in tags) == n * chunks


@pytest.mark.parametrize("name", ["ring-zigzag-causal-mha-cp4", "ring-none-causal-gqa-cp4",
                                  "ring-zigzag-causal-gqa-cp2tp2", "ring-chunks1-zigzag-causal-mha-cp4"])
def test_ring_bytes(results4, name):
    _check_ring_bytes(_ok(results4, name), n=CASES4[name]["axes"]["cp"], chunks=_chunks(name, CASES4))


def test_ring_low_precision_accumulates_and_carries_fp32(results4):
    for res in _ok(results4, "ring-bf16-zigzag-causal-gqa-cp4"):
        kv = res["k_local"]  # bf16 K+V of one of the 2 head chunks
        assert [(r["bytes"], r["dtype"]) for r in res["fwd"]] == [(kv, "torch.bfloat16")] * 3 * 2
        dkv = [(r["bytes"], r["dtype"]) for r in res["bwd"] if r["tag"].startswith("ring bwd dkv")]
        assert dkv == [(2 * kv, "torch.float32")] * 4 * 2  # dK/dV partials travel in fp32


def test_ring_of_one_sends_nothing(results4):
    for res in _ok(results4, "ring-size1"):
        assert res["fwd"] == [] and res["bwd"] == []


@pytest.mark.parametrize("name, repeat", [
    ("ulysses-zigzag-causal-mha-cp4", 1),
    ("ulysses-none-causal-gqarepeat-cp4", 2),  # 2 kv heads repeated up to cp = 4
    ("ulysses-zigzag-full-gqa-dp2cp2", 1),
    ("ulysses-zigzag-causal-gqarepeat-cp2tp2", 2),  # 1 kv head per tp rank, cp = 2
    ("ulysses-chunked-zigzag-causal-gqa-cp2", 1),  # 2 head chunks
])
def test_ulysses_is_four_all_to_alls(results4, name, repeat):
    chunks = _chunks(name, CASES4)
    assert chunks == (2 if "chunked" in name else 1)
    _check_ulysses_bytes(_ok(results4, name), n=CASES4[name]["axes"]["cp"], repeat=repeat, chunks=chunks)


def _check_ulysses_bytes(per_rank: list[dict], n: int, repeat: int, chunks: int = 1, axis: str = "cp") -> list:
    """4 all-to-alls (q, k, v, out) of (n-1)/n of the local tensors — (n-1)/n² of the
    global ones per cp group — forward and backward, split evenly over the head chunks.
    Returns what the checks left (the ring's transfers in a hybrid)."""
    for res in per_rank:
        ql, kl = res["q_local"], res["k_local"] * repeat
        want = sorted([("all_to_all", axis, (n - 1) * b // n // chunks) for b in (ql, kl, kl, ql)] * chunks)
        for phase in ("fwd", "bwd"):
            got = sorted(x for x in _summary(res[phase]) if x[0] == "all_to_all")
            assert got == want, (phase, got, want)
            assert sum(x[2] for x in got) == (n - 1) * (2 * ql + 2 * kl) // n


def test_double_ring_bytes(results4):
    for name in ("double_ring-w2-zigzag-causal-gqa-cp4", "double_ring-w2-zigzag-full-gqa-cp4",
                 "double_ring-w2-none-causal-mha-cp4"):
        _check_double_ring_bytes(_ok(results4, name), n=4, w=2, chunks=_chunks(name, CASES4))


def _check_double_ring_bytes(per_rank: list[dict], n: int, w: int, chunks: int) -> None:
    for res in per_rank:
        kv = 2 * res["k_local"] // chunks
        fwd = _summary(res["fwd"])
        # Same volume as the single ring: n-1 blocks, (n/w)(w-1) inner + n/w - 1 outer hops.
        assert sorted(fwd) == sorted(([("send_recv", "cp_inner", kv)] * (n // w) * (w - 1)
                                      + [("send_recv", "cp_outer", kv)] * (n // w - 1)) * chunks)
        bwd = _summary(res["bwd"])
        assert sorted(bwd) == sorted(([("send_recv", "cp_inner", kv)] * ((n // w) * (w - 1) + n)
                                      + [("send_recv", "cp_outer", kv)] * (n // w - 1 + n // w)) * chunks)


@pytest.mark.parametrize("name, repeat", [
    ("hybrid-u2-zigzag-causal-gqa-cp4", 1), ("hybrid-u2-none-causal-gqarepeat-cp4", 2),
    ("hybrid-u2-none-full-mha-cp4", 1), ("hybrid-chunks1-u2-zigzag-causal-mha-cp4", 1)])
def test_hybrid_bytes(results4, name, repeat):
    _check_hybrid_bytes(_ok(results4, name), u=2, R=2, repeat=repeat, chunks=_chunks(name, CASES4))


def _check_hybrid_bytes(per_rank: list[dict], u: int, R: int, repeat: int, chunks: int) -> None:
    _check_ulysses_bytes(per_rank, n=u, repeat=repeat, chunks=chunks, axis="cp_uly")
    for res in per_rank:
        kv = 2 * res["k_local"] * repeat // chunks  # heads/u, seq×u: per chunk, local K+V / chunks
        ring = [x for x in _summary(res["fwd"]) if x[0] != "all_to_all"]
        assert ring == [("send_recv", "cp_ring", kv)] * (R - 1) * chunks
        ring = [x for x in _summary(res["bwd"]) if x[0] != "all_to_all"]
        assert ring == [("send_recv", "cp_ring", kv)] * (2 * R - 1) * chunks


# ---------------------------------------------------------------- overlap


def _check_overlap(res: dict) -> int:
    """Every ring transfer is posted before the block compute it overlaps starts and is
    still in flight when that compute starts; the next block's compute starts only after
    it arrived. Returns the number of transfers checked."""
    ev = {(e["phase"], e["step"]): e for e in res["events"]}
    checked = 0
    for phase, recs in (("fwd", res["fwd"]), ("bwd", res["bwd"])):
        for r in recs:
            m = re.fullmatch(r"ring (fwd|bwd) step (\d+)", r["tag"])
            if not m:
                continue
            i = int(m.group(2))
            e = ev[(phase, i)]
            assert r["issued"] < e["start"], f"{r['tag']} posted after its overlapping compute started"
            assert r["completed"] is not None and r["completed"] > e["start"], f"{r['tag']} not in flight"
            if (phase, i + 1) in ev:
                assert ev[(phase, i + 1)]["start"] >= r["completed"] - 1e-9
            checked += 1
        for r in recs:  # the outer ring's prefetch spans the whole inner round
            m = re.fullmatch(r"ring (fwd|bwd) outer (\d+)", r["tag"])
            if m:
                first = ev[(phase, int(m.group(2)) * 2)]  # window 2 in the double-ring cases
                assert r["issued"] < first["start"] < r["completed"]
    return checked


@pytest.mark.parametrize("name, n_inner", [
    ("ring-zigzag-causal-mha-cp4", 2 * 3),
    ("ring-none-causal-gqa-cp4", 2 * 3),
    ("double_ring-w2-zigzag-causal-gqa-cp4", 2 * 2),
    ("hybrid-u2-zigzag-causal-gqa-cp4", 2 * 1),
])
def test_ring_transfers_overlap_compute(results4, name, n_inner):
    for res in _ok(results4, name):
        # forward and backward K/V hops within the (inner) ring, for every head chunk
        assert _check_overlap(res) == n_inner * _chunks(name, CASES4)


# ---------------------------------------------------------------- balance


def _work(res: dict, n: int) -> int:
    """Score blocks computed in forward by the first head chunk's ring (steps 0..n-1),
    in the unit of causal_work (a zigzag chunk²)."""
    unit = res["L"] // 2
    total = 0
    for e in res["events"]:
        if e["phase"] != "fwd" or e["step"] >= n:
            continue
        for qa, qb, ka, kb, mask in e["tasks"]:
            nq, nk = (qb - qa) // unit, (kb - ka) // unit
            total += nq * nk if mask == "full" else sum(min(a + 1, nk) for a in range(nq))
    return total


def test_zigzag_balances_causal_work(results4):
    zz = [_work(res, 4) for res in sorted(_ok(results4, "ring-zigzag-causal-mha-cp4"), key=lambda r: r["rank"])]
    assert zz == [causal_work(r, 4, "zigzag") for r in range(4)] == [9] * 4
    plain = [_work(res, 4) for res in sorted(_ok(results4, "ring-none-causal-gqa-cp4"), key=lambda r: r["rank"])]
    assert plain == [causal_work(r, 4, None) for r in range(4)] == [3, 7, 11, 15]


# ---------------------------------------------------------------- hybrid reorder (no ranks)


@pytest.mark.parametrize("cp, u", [(4, 2), (8, 2), (8, 4), (6, 3), (4, 4), (2, 2)])
def test_ulysses_slots_turn_cp_zigzag_into_ring_zigzag(cp, u):
    """Placing the u gathered pieces by :func:`_slots` gives the ring group's zigzag order
    over R = cp/u (for R = 1, plain Ulysses: the original order)."""
    from dtp.ops.context.ulysses import _slots

    S = 4 * cp
    L, R = S // cp, cp // u
    pos = zigzag_permutation(S, cp)  # global position of each cp-ordered token
    ring = zigzag_permutation(S, R)
    for g in range(R):
        pieces = pos[g * u * L:(g + 1) * u * L].view(u, L)  # what the Ulysses group's all-to-all brings
        gathered = torch.empty(u * L, dtype=pos.dtype)
        for j, places in enumerate(_slots(u, L, zigzag=True)):
            for dst, src in places:
                gathered[dst] = pieces[j, src]
        assert torch.equal(gathered, ring[g * u * L:(g + 1) * u * L])
    if R == 1:
        assert torch.equal(gathered, torch.arange(S))


# ---------------------------------------------------------------- the layout owns the order (no ranks)


def test_layout_to_cp_order_reads_the_layout_and_round_trips():
    import dtp
    from dtp import layouts
    from dtp.ops.blockwise import from_cp_order, to_cp_order
    from dtp.testing import simulate

    x = torch.arange(2 * 16).view(2, 16)
    with simulate(8):
        mesh = dtp.make_mesh(dp=2, cp=4)
        ring, plain = layouts.context("ring"), layouts.context("ulysses", load_balance=None)
        y = ring.to_cp_order(x, 1, mesh)
        assert ring.context_degree(mesh) == 4
        assert torch.equal(y, to_cp_order(x, 1, 4, "zigzag"))
        assert y[0, :4].tolist() == [0, 1, 14, 15]  # rank 0 of cp=4: chunks 0 and 7
        assert torch.equal(ring.from_cp_order(y, 1, mesh), x)
        assert torch.equal(from_cp_order(y, 1, 4, "zigzag"), x)
        combined = layouts.data() + layouts.megatron(sequence_parallel=True) + ring  # composes with +
        assert torch.equal(combined.to_cp_order(x, 1, mesh), y)
        for identity in (plain, layouts.data(), dtp.Layout()):  # contiguous shards / no context parallel
            assert identity.to_cp_order(x, 1, mesh) is x and identity.from_cp_order(x, 1, mesh) is x
        with pytest.raises(ValueError, match=r"divisible by 2\*cp"):
            ring.to_cp_order(torch.arange(12), 0, mesh)
        assert ring.to_cp_order(x, 1, dtp.make_mesh(dp=2, cp=1, tp=4)) is x  # cp of one: nothing to balance
        assert ring.to_cp_order(x, 1, dtp.make_mesh(dp=8)) is x  # mesh without the cp axis


# ---------------------------------------------------------------- validation


def _expect_errors(cases: list[tuple]) -> list[tuple[str, str, int]]:
    import dtp
    from dtp.ops import context as C

    out = []
    for axes, shape, spec, algo, kw in cases:
        mesh = dtp.make_mesh(**axes)
        b, hq, hkv, S = shape
        q = torch.randn(b, hq, S, 4, dtype=F64)
        kv = torch.randn(b, hkv, S, 4, dtype=F64)
        if spec is None:  # plain tensors
            args = (q, kv, kv)
        else:
            args = (dtp.shard(q, mesh, spec), dtp.shard(kv, mesh, spec), dtp.shard(kv, mesh, spec))
        with dtp.comm_log() as log:
            try:
                C.context_attention(*args, algo=algo, **kw)
                out.append(("no error", "", len(log)))
            except (ValueError, TypeError) as e:
                out.append((type(e).__name__, str(e), len(log)))
    return out


@pytest.mark.parametrize("cp, window, message", [
    (2, 1, r"^layouts.context: double_ring needs window > 1 \(window=1 is the plain ring: use algo='ring'\)$"),
    (2, 2, r"cp=2 has no such window \(got window=2\): use algo='ring'$"),
    (4, 4, r"window < cp and cp divisible by window; got window=4 at cp=4 \(valid: \[2\]\)$"),
    (4, 3, r"got window=3 at cp=4 \(valid: \[2\]\)$"),
    (4, 2, None),
    (8, 4, None),
])
def test_double_ring_window_rule_of_the_layout(cp, window, message):
    """The layout states the one window rule (dtp.layouts.check_window) that the op
    checks too (the table above): at cp 2 every window is refused the same way."""
    import dtp
    from dtp import layouts
    from dtp.testing import simulate

    sizes = {"heads": 4, "kv_heads": 2}
    with simulate(cp):
        mesh = dtp.make_mesh(cp=cp)
        if message is None:
            layouts.context("double_ring", window=window).check_sizes(sizes, mesh)
            return
        with pytest.raises(ValueError, match=message):
            layouts.context("double_ring", window=window).check_sizes(sizes, mesh)


def test_validation_errors_before_any_collective():
    from dtp import P

    cp = P(None, None, "cp")
    cases = [
        # (axes, (b, hq, hkv, S), spec, algo, kwargs), expected type, message pattern
        (({"cp": 4}, (1, 2, 2, 12), cp, "ring", {}), "ValueError", r"divisible by 2\*cp.*seq=12, cp=4"),
        (({"cp": 4}, (1, 4, 4, 12), cp, "ulysses", {}), "ValueError", r"2\*cp"),
        (({"cp": 4}, (1, 2, 2, 12), cp, "ring", {"load_balance": None}), "no error", ""),
        (({"cp": 4}, (1, 2, 2, 16), cp, "double_ring", {"window": 4}), "ValueError",
         r"double_ring needs window > 1, window < cp and cp divisible by window; got window=4 at cp=4 \(valid: \[2\]\)"),
        (({"cp": 4}, (1, 2, 2, 16), cp, "double_ring", {"window": 2}), "no error", ""),
        (({"cp": 4}, (1, 2, 2, 16), cp, "double_ring", {"window": 1}), "ValueError",
         r"double_ring needs window > 1 \(window=1 is the plain ring: use algo='ring'\)"),
        # cp 2 has no window for a double ring (1 is the plain ring, 2 is one window of all)
        (({"dp": 2, "cp": 2}, (1, 2, 2, 8), cp, "double_ring", {"window": 2}), "ValueError",
         r"cp=2 has no such window \(got window=2\): use algo='ring'"),
        (({"dp": 2, "cp": 2}, (1, 2, 2, 8), cp, "double_ring", {"window": 1}), "ValueError",
         r"window=1 is the plain ring: use algo='ring'"),
        (({"cp": 4}, (1, 2, 2, 16), cp, "double_ring", {"window": 3}), "ValueError", r"window"),
        (({"cp": 4}, (1, 2, 2, 16), cp, "double_ring", {"window": 0}), "ValueError", r"window"),
        (({"cp": 4}, (1, 6, 6, 16), cp, "ulysses", {}), "ValueError", r"heads=6.*tp × cp = 1 × 4"),
        (({"cp": 2, "tp": 2}, (1, 6, 2, 8), P(None, "tp", "cp"), "ulysses", {}), "ValueError",
         r"heads=6.*tp × cp = 2 × 2.*tp=2, cp=2"),
        (({"cp": 4}, (1, 12, 3, 16), cp, "ulysses", {}), "ValueError", r"3 kv heads"),
        (({"cp": 4}, (1, 4, 4, 16), cp, "hybrid", {"ulysses_degree": 4}), "ValueError", r"ring degree.*must be > 1"),
        (({"cp": 4}, (1, 3, 3, 16), cp, "hybrid", {"ulysses_degree": 2}), "ValueError",
         r"heads=3.*tp × ulysses_degree = 1 × 2"),
        (({"cp": 4}, (1, 4, 4, 16), cp, "hybrid", {"ulysses_degree": 2, "window": 2}), "ValueError", r"window"),
        (({"cp": 4}, (1, 4, 4, 16), cp, "hybrid", {"ulysses_degree": 3}), "ValueError", r"ulysses_degree"),
        (({"cp": 4}, (1, 2, 2, 16), cp, "ring", {"load_balance": "striped"}), "ValueError", r"load_balance"),
        (({"cp": 4}, (1, 2, 2, 16), P(None, None, None), "ring", {}), "ValueError", r"split the sequence"),
        (({"cp": 4}, (1, 2, 2, 16), cp, "ring", {"axis": "sp"}), "ValueError", r"unknown mesh axis 'sp'"),
        (({"cp": 4}, (1, 2, 2, 16), None, "ring", {}), "TypeError", r"must be a DTensor"),
        (({"cp": 4}, (1, 2, 2, 16), cp, "striped", {}), "ValueError", r"algo must be one of"),
        (({"cp": 4}, (1, 4, 2, 16), cp, "ring", {"head_chunks": 3}), "ValueError",
         r"head_chunks.*dividing the 2 kv heads.*got head_chunks=3"),
        (({"cp": 4}, (1, 4, 2, 16), cp, "double_ring", {"window": 2, "head_chunks": 0}), "ValueError",
         r"head_chunks"),
        (({"dp": 2, "cp": 2}, (1, 4, 4, 16), cp, "ulysses", {"head_chunks": 4}), "ValueError",
         r"head_chunks.*dividing the 2 kv heads each rank holds after the all-to-all"),
        (({"cp": 4}, (1, 4, 2, 16), cp, "hybrid", {"ulysses_degree": 2, "head_chunks": 2}), "ValueError",
         r"dividing the 1 kv heads"),
    ]
    results = run(_expect_errors, [c for c, _, _ in cases], world_size=4)
    for rank_results in results:
        for (case, kind, pattern), (got_kind, msg, n_records) in zip(cases, rank_results):
            assert got_kind == kind, f"{case}: expected {kind}, got {got_kind}: {msg}"
            assert re.search(pattern, msg), f"{case}: {msg!r} does not match {pattern!r}"
            if kind != "no error":
                assert n_records == 0, f"{case}: {n_records} collectives before the error"


# ---------------------------------------------------------------- autograd contract


def _autograd_contract(impl: str | None) -> dict:
    """Ulysses / hybrid save through the saved-tensors hooks (so full recompute and offload
    see their chunks), save nothing under no_grad, refuse a second backward clearly, and
    match single-device SDPA under non-reentrant checkpoint and on the recompute path
    taken where no fused block backward exists (``impl="math"``)."""
    import os

    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    import dtp
    from dtp import P
    from dtp.ops import context as C
    from dtp.ops.blockwise import from_cp_order, to_cp_order
    from dtp.redistribute import to_local

    if impl is not None:
        os.environ["DTP_BLOCKWISE_IMPL"] = impl
    try:
        mesh = dtp.make_mesh(cp=4)
        g = torch.Generator().manual_seed(1)
        out = {}
        for name, algo, hkv, kw in (
            ("ulysses", "ulysses", 8, {"head_chunks": 2}),
            ("hybrid", "hybrid", 8, {"ulysses_degree": 2, "head_chunks": 2}),
            ("ulysses-gqa-full-scaled", "ulysses", 4, {"causal": False, "scale": 0.3}),
        ):
            q = torch.randn(2, 8, 16, 4, dtype=F64, generator=g)
            k, v = (torch.randn(2, hkv, 16, 4, dtype=F64, generator=g) for _ in range(2))
            causal, scale = kw.get("causal", True), kw.get("scale")
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale,
                                           enable_gqa=True).square().sum().backward()

            def shards():
                return [dtp.shard(to_cp_order(t, 2, 4), mesh, P(None, None, "cp")).requires_grad_() for t in (q, k, v)]

            def attend(a, b, c):
                return to_local(C.context_attention(a, b, c, algo=algo, **kw))

            packed = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
                a, b, c = shards()
                o = attend(a, b, c)
            n_packed = len(packed)
            with torch.no_grad():
                packed.clear()
                with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
                    attend(*shards())
            n_packed_no_grad = len(packed)
            o.square().sum().backward(retain_graph=True)
            try:
                o.square().sum().backward()
                second = "no error"
            except RuntimeError as e:
                second = str(e)
            a2, b2, c2 = shards()  # non-reentrant checkpoint: recomputed in backward
            checkpoint(attend, a2, b2, c2, use_reentrant=False).square().sum().backward()
            errs = []
            for what, t, ref in (("dq", a2, qr), ("dk", b2, kr), ("dv", c2, vr), ("dq once", a, qr)):
                got = from_cp_order(t.grad.full_tensor(), 2, 4)
                if not torch.allclose(got, ref.grad, rtol=1e-10, atol=1e-10):
                    errs.append(f"{what}: max err {(got - ref.grad).abs().max().item():.2e}")
            out[name] = dict(packed=n_packed, packed_no_grad=n_packed_no_grad, second=second, errors=errs)
        return out
    finally:
        os.environ.pop("DTP_BLOCKWISE_IMPL", None)


@pytest.mark.parametrize("impl", [None, "math"])
def test_ulysses_autograd_contract(impl):
    for per_rank in run(_autograd_contract, impl, world_size=4):
        for name, res in per_rank.items():
            assert not res["errors"], (name, res["errors"])
            # Per head chunk, the gathered q, k, v, out and LSE went through the hooks --
            # or only q, k, v where backward recomputes (no fused block backward: "math").
            per_chunk = 3 if impl == "math" and name.startswith("ulysses") else 5
            chunks = 1 if name == "ulysses-gqa-full-scaled" else 2
            assert res["packed"] == per_chunk * chunks, (name, res)
            assert res["packed_no_grad"] == 0, (name, res)
            assert "second time" in res["second"] and "retain_graph" in res["second"], (name, res["second"])


def test_default_chunks():
    """The fewest chunks with chunks × cp >= 16, none under 1 MiB of K+V, 1 when small."""
    from dtp.ops.context import default_chunks

    mib = 1 << 20
    assert default_chunks(8, 4, 64 * mib) == 4 and default_chunks(8, 2, 64 * mib) == 8
    assert default_chunks(8, 16, 64 * mib) == 1  # cp alone reaches the target
    assert default_chunks(8, 4, 2 * mib) == 2  # 4 chunks would be 0.5 MiB each
    assert default_chunks(8, 4, mib - 1) == 1 and default_chunks(6, 4, 64 * mib) == 6  # 4 does not divide 6
    assert default_chunks(1, 2, 64 * mib) == 1
