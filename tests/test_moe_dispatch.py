"""Expert-parallel dispatch and combine (dtp.ops.moe_dispatch) and dtp.comm's uneven
all-to-all, on CPU gloo ranks, fp64.

Each case runs dispatch → per-expert function → combine on every rank and is checked
against the same math on one process holding every rank's rows: the forward exactly, the
gradients of x and of the expert weights to 1e-12. Uneven counts include an expert with
no rows and a rank that sends none. The comm log must be exactly: the counts exchange,
dispatch, combine, and the two backward exchanges, with bytes equal to the rows sent to
other ranks × bytes per row. All cases of one world size run in one pool call.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from dtp.testing import run

F64 = torch.float64

CASES = {
    # name: world size, experts, rows per rank, feature dims in → out, forced ids
    "ep2 even": dict(n=2, E=4, rows=[6, 6], d=3, o=3),
    "ep2 top2 rows, out dim differs": dict(n=2, E=2, rows=[8, 4], d=2, o=5),
    "ep4 one expert each": dict(n=4, E=4, rows=[5, 7, 3, 9], d=3, o=3),
    # expert 3 gets nothing, rank 2 sends nothing, rank 1 keeps everything at home
    "ep4 uneven, empty expert and rank": dict(n=4, E=8, rows=[9, 6, 0, 11], d=4, o=2,
                                              ids={1: [2, 2, 2, 2, 2, 2]}, never=3),
}


def _inputs(name: str, case: dict, rank: int):
    g = torch.Generator().manual_seed(1000 * sorted(CASES).index(name) + rank)
    rows = case["rows"][rank]
    x = torch.randn(rows, case["d"], dtype=F64, generator=g)
    if rank in case.get("ids", {}):
        ids = torch.tensor(case["ids"][rank], dtype=torch.int64)
    else:
        ids = torch.randint(0, case["E"], (rows,), generator=g)
        if "never" in case:
            ids[ids == case["never"]] = (case["never"] + 1) % case["E"]
    w = torch.randn(rows, case["o"], dtype=F64, generator=g)  # upstream weights of the loss
    return x, ids, w


def _weights(name: str, case: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + sorted(CASES).index(name))
    return torch.randn(case["E"], case["d"], case["o"], dtype=F64, generator=g)


def _rank_cases(names: list[str]) -> dict:
    import dtp
    from dtp import comm
    from dtp.ops.moe_dispatch import combine, dispatch

    out = {}
    for name in names:
        try:
            case = CASES[name]
            mesh = dtp.make_mesh(ep=case["n"])
            me = mesh.get_local_rank("ep")
            x, ids, w = _inputs(name, case, me)
            L = case["E"] // case["n"]
            W = _weights(name, case)[me * L:(me + 1) * L].clone().requires_grad_()
            x = x.requires_grad_()
            with comm.comm_log() as log:
                y, plan = dispatch(x, ids, case["E"], mesh, "ep")
                # (a) exact: each row times its global expert index + 1
                scale = torch.repeat_interleave(torch.arange(L, dtype=F64) + me * L + 1,
                                                torch.tensor(plan.tokens_per_expert))
                scaled = combine(y * scale[:, None], plan)
                # (b) a grouped matmul over the local experts, then a loss
                parts = torch.split(y, list(plan.tokens_per_expert))
                h = torch.cat([p @ W[e] for e, p in enumerate(parts)]) if parts else y.new_empty(0, case["o"])
                z = combine(h, plan)
                (z * w).sum().backward()
            out[name] = dict(scaled=scaled.detach(), z=z.detach(), dx=x.grad, dW=W.grad,
                             tokens=plan.tokens_per_expert,
                             records=[(r.kind, r.axis, r.tag, r.bytes) for r in log.records])
        except Exception:
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    got = {}
    for n in (2, 4):
        names = [k for k, c in CASES.items() if c["n"] == n]
        by_rank = run(_rank_cases, names, world_size=n)
        for name in names:
            got[name] = [r[name] for r in by_rank]
    return got


def _case(results: dict, name: str) -> list[dict]:
    ranks = results[name]
    for r, res in enumerate(ranks):
        if isinstance(res, str):
            pytest.fail(f"{name}: rank {r} failed:\n{res}")
    return ranks


def _reference(name: str):
    """Every rank's rows on one process: z = x @ W[id], its loss's gradients."""
    case = CASES[name]
    W = _weights(name, case).requires_grad_()
    xs, ids, ws = zip(*(_inputs(name, case, r) for r in range(case["n"])))
    xs = [x.requires_grad_() for x in xs]
    zs = [torch.einsum("nd,ndo->no", x, W[i]) for x, i in zip(xs, ids)]
    sum((z * w).sum() for z, w in zip(zs, ws)).backward()
    return xs, ids, zs, W.grad


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_expert_combine_equals_one_process(results, name) -> None:
    ranks = _case(results, name)
    xs, ids, zs, dW = _reference(name)
    case = CASES[name]
    L = case["E"] // case["n"]
    for r, res in enumerate(ranks):
        assert torch.equal(res["scaled"], xs[r].detach() * (ids[r].to(F64) + 1)[:, None]), f"{name}: rank {r}"
        torch.testing.assert_close(res["z"], zs[r].detach(), rtol=1e-12, atol=1e-12, msg=f"{name}: rank {r} z")
        torch.testing.assert_close(res["dx"], xs[r].grad, rtol=1e-12, atol=1e-12, msg=f"{name}: rank {r} dx")
        torch.testing.assert_close(res["dW"], dW[r * L:(r + 1) * L], rtol=1e-12, atol=1e-12,
                                   msg=f"{name}: rank {r} dW")
        counts = torch.bincount(torch.cat(ids), minlength=case["E"])[r * L:(r + 1) * L]
        assert res["tokens"] == tuple(counts.tolist()), f"{name}: rank {r} tokens per local expert"


def test_uneven_case_has_an_empty_expert_and_an_empty_rank() -> None:
    name = "ep4 uneven, empty expert and rank"
    _, ids, _, _ = _reference(name)
    assert ids[2].numel() == 0
    assert torch.bincount(torch.cat(ids), minlength=8)[3] == 0


@pytest.mark.parametrize("name", list(CASES))
def test_comm_log_is_counts_then_the_four_exchanges_with_analytic_bytes(results, name) -> None:
    ranks = _case(results, name)
    case = CASES[name]
    n, L, d, o = case["n"], case["E"] // case["n"], case["d"], case["o"]
    _, ids, _, _ = _reference(name)
    owner = [i // L for i in ids]
    for r, res in enumerate(ranks):
        sent = int((owner[r] != r).sum())  # my rows that leave
        came = sum(int((owner[s] == r).sum()) for s in range(n) if s != r)  # others' rows to me
        # one dispatch (counts, rows), the scaled combine (d features), the matmul's combine
        # (o features); backward: combine's (the loss's o-gradients go to the experts), then
        # dispatch's (d-gradients come home). The scaled branch is outside the loss.
        assert res["records"] == [
            ("all_to_all", "ep", "moe dispatch counts", (n - 1) * L * 8),
            ("all_to_all_v", "ep", "moe dispatch", sent * d * 8),
            ("all_to_all_v", "ep", "moe combine", came * d * 8),
            ("all_to_all_v", "ep", "moe combine", came * o * 8),
            ("all_to_all_v", "ep", "moe combine backward", sent * o * 8),
            ("all_to_all_v", "ep", "moe dispatch backward", came * d * 8),
        ], f"{name}: rank {r}"
