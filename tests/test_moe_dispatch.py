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


# ------------------------------------------------------------------ comm, ep of one, errors


def _rank_checks() -> dict:
    import dtp
    from dtp import comm
    from dtp.ops.moe_dispatch import combine, dispatch

    mesh = dtp.make_mesh(ep=2)
    me = mesh.get_local_rank("ep")
    out: dict = {}

    def attempt(key, fn):
        with comm.comm_log() as log:
            try:
                fn()
                out[key] = ("no error", [])
            except ValueError as e:
                out[key] = (str(e), [(r.kind, r.tag) for r in log.records])

    # an async uneven all-to-all: rank 0 sends 3 rows to 1 and none to itself, rank 1 sends 1 to each
    send, recv = ([0, 3], [0, 1]) if me == 0 else ([1, 1], [3, 1])
    x = torch.arange(sum(send) * 2, dtype=F64).reshape(-1, 2) + 100 * me
    with comm.comm_log() as log:
        handle = comm.all_to_all_v(x, mesh, "ep", send_counts=send, recv_counts=recv, async_op=True, tag="a2av")
        got = handle.wait()
        counts = comm.exchange_counts(torch.tensor([[1, 2], [3, 4]]) + 10 * me, mesh, "ep")
    out["a2av"] = got
    out["counts"] = counts
    out["records"] = [(r.kind, r.tag, r.bytes, r.async_op, r.completed is not None) for r in log.records]
    out["flight"] = [(e.kind, e.tag, e.bytes) for e in comm.flight_record()[-2:]]

    # ep of one: a local permutation and back, nothing recorded
    mesh1 = dtp.make_mesh(dp=2, ep=1)
    x1 = torch.randn(5, 3, dtype=F64, requires_grad=True)
    with comm.comm_log() as log1:
        y1, plan1 = dispatch(x1, torch.tensor([2, 0, 1, 0, 2]), 3, mesh1, "ep")
        z1 = combine(y1 * 2, plan1)
        z1.sum().backward()
    out["ep1"] = (torch.equal(z1, 2 * x1.detach()), torch.equal(x1.grad, torch.full_like(x1, 2.0)),
                  plan1.tokens_per_expert, len(log1.records), torch.equal(y1, x1.detach()[[1, 3, 2, 0, 4]]))

    xs = torch.ones(4, 2, dtype=F64)
    attempt("ids out of range on rank 1",
            lambda: dispatch(xs, torch.tensor([0, 1, 2, 4 if me == 1 else 3]), 4, mesh, "ep"))
    attempt("ids length on rank 0", lambda: dispatch(xs, torch.zeros(3 if me == 0 else 4, dtype=torch.int64),
                                                     4, mesh, "ep"))
    attempt("float ids", lambda: dispatch(xs, torch.zeros(4), 4, mesh, "ep"))
    attempt("experts not divisible", lambda: dispatch(xs, torch.zeros(4, dtype=torch.int64), 3, mesh, "ep"))
    attempt("send counts do not sum", lambda: comm.all_to_all_v(xs, mesh, "ep", send_counts=[1, 2],
                                                                recv_counts=[1, 2]))
    attempt("one count per coordinate", lambda: comm.all_to_all_v(xs, mesh, "ep", send_counts=[4],
                                                                  recv_counts=[2, 2]))
    attempt("counts not int64", lambda: comm.exchange_counts(torch.zeros(2, dtype=torch.int32), mesh, "ep"))
    y, plan = dispatch(xs, torch.tensor([0, 1, 2, 3]), 4, mesh, "ep")
    attempt("combine rows", lambda: combine(y[1:], plan))
    return out


@pytest.fixture(scope="module")
def checks() -> list[dict]:
    return run(_rank_checks, world_size=2)


def test_all_to_all_v_async_is_uneven_recorded_and_flight_recorded(checks) -> None:
    r0, r1 = checks
    assert r0["a2av"].tolist() == [[100.0, 101.0]]  # rank 1's first row; rank 0 kept nothing
    assert r1["a2av"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [102.0, 103.0]]
    # bytes: rows to the other coordinate × 16 (rank 0 sends 3, rank 1 sends 1)
    assert r0["records"][0] == ("all_to_all_v", "a2av", 3 * 16, True, True)
    assert r1["records"][0] == ("all_to_all_v", "a2av", 1 * 16, True, True)
    assert r0["flight"][0] == ("all_to_all_v", "a2av", 48)


def test_exchange_counts_is_a_recorded_all_to_all_of_the_counts(checks) -> None:
    r0, r1 = checks
    assert r0["counts"].tolist() == [[1, 2], [11, 12]]  # [source][...]: row 0 of each rank
    assert r1["counts"].tolist() == [[3, 4], [13, 14]]
    for r in checks:
        assert r["records"][1] == ("all_to_all", "counts", 2 * 8, False, True)
        assert r["flight"][1] == ("all_to_all", "counts", 16)


def test_ep_of_one_permutes_locally_and_records_nothing(checks) -> None:
    for r in checks:
        assert r["ep1"] == (True, True, (2, 1, 2), 0, True)


ERRORS = [
    # case, message on rank 0, on rank 1, collectives before the error
    ("ids out of range on rank 1", r"coordinate\(s\) \[1\] are invalid",
     r"must lie in \[0, 4\), got values in \[0, 4\]",
     [("all_to_all", "moe dispatch counts")]),
    ("ids length on rank 0", r"one id per row of x, got \(3,\)", r"coordinate\(s\) \[0\] are invalid",
     [("all_to_all", "moe dispatch counts")]),
    ("float ids", "must be an integer tensor", "must be an integer tensor", [("all_to_all", "moe dispatch counts")]),
    ("experts not divisible", r"divisible by the 'ep' size 2, got 3", r"divisible by the 'ep' size 2, got 3", []),
    ("send counts do not sum", r"must sum to the rows of x", r"must sum to the rows of x", []),
    ("one count per coordinate", r"send_counts must be 2 ints >= 0", r"send_counts must be 2 ints >= 0", []),
    ("counts not int64", r"counts must be int64 with dim 0 of size 2", r"counts must be int64", []),
    ("combine rows", r"must have the \d+ rows dispatch delivered", r"must have the \d+ rows dispatch delivered", []),
]


@pytest.mark.parametrize("case, says0, says1, before", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_is_a_value_error_on_every_rank_before_the_token_exchange(checks, case, says0, says1,
                                                                            before) -> None:
    import re
    for r, says in ((0, says0), (1, says1)):
        message, records = checks[r][case]
        assert re.search(says, message), f"{case}: rank {r} said {message!r}"
        assert records == before, f"{case}: rank {r}"
