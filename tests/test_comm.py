"""dtp.comm's flight recorder: the last FLIGHT_SLOTS collectives, numbered in posting order
and the same on every rank; its file mirror (what the launcher reads after a rank died);
CollectiveError, the one line a rank says when a collective fails in the backend; and what
the simulated link makes of point-to-point transfers. (Collective results and byte counts are tested with the modules that issue them.)"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import dtp
from dtp import comm
from dtp.testing import run, simulate


def _collectives(count: int) -> list[tuple[int, str, str, str, int, str]]:
    mesh = dtp.make_mesh(dp=2)
    before = comm.flight_record()[-1].seq if comm.flight_record() else 0
    for i in range(count):
        comm.all_reduce(torch.ones(4), mesh, "dp", tag=f"step {i}")
    comm.all_gather(torch.ones(2), mesh, "dp", async_op=True, tag="left in flight?").wait()
    return [(e.seq - before, e.kind, e.axis, e.tag, e.bytes, e.state) for e in comm.flight_record()]


def test_flight_record_keeps_the_last_collectives_in_posting_order_on_every_rank() -> None:
    by_rank = run(_collectives, 40, world_size=2)
    assert by_rank[0] == by_rank[1]  # same program, same numbers: ranks can be compared
    entries = by_rank[0]
    assert len(entries) == comm.FLIGHT_SLOTS
    assert [e[0] for e in entries] == list(range(41 - comm.FLIGHT_SLOTS + 1, 42))
    assert entries[-2] == (40, "all_reduce", "dp", "step 39", 16, "done")  # 2 (n-1)/n × 16 bytes
    assert entries[-1] == (41, "all_gather", "dp", "left in flight?", 8, "done")


def test_axis_of_one_is_not_recorded() -> None:
    with simulate(2):
        mesh = dtp.make_mesh(dp=2, tp=1)
        comm.all_reduce(torch.ones(3), mesh, "dp", tag="moves")
        comm.all_reduce(torch.ones(3), mesh, "tp", tag="moves nothing")
    assert comm.flight_record()[-1].tag == "moves"


def test_file_mirror_matches_the_record_and_marks_failures(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(comm.FLIGHT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(comm.flight, "_mirror", False)  # look at the environment again
    with simulate(2):
        mesh = dtp.make_mesh(dp=2)
        for i in range(comm.FLIGHT_SLOTS + 5):  # the file's slots wrap like the ring
            comm.all_reduce(torch.ones(8), mesh, "dp", tag=f"bucket {i}")
        handle = comm.all_gather(torch.ones(2), mesh, "dp", async_op=True, tag="x" * 60)
        handle.wait()
    in_process = comm.flight_record()
    on_file = comm.flight_record(tmp_path / "flight-rank3.bin")
    assert [(e.seq, e.kind, e.axis, e.bytes, e.state) for e in on_file] == \
        [(e.seq, e.kind, e.axis, e.bytes, e.state) for e in in_process]
    assert [e.tag for e in on_file[:-1]] == [e.tag for e in in_process[:-1]]
    assert on_file[-1].tag == "x" * 40  # cut to its slot
    assert all(abs(a.posted - b.posted) < 0.01 and abs(a.completed - b.completed) < 0.01
               for a, b in zip(on_file, in_process))

    # A collective that fails in the backend is marked failed, in the ring and on file.
    record = comm.flight._record("reduce_scatter", "dp", 64, 2, torch.ones(4), True, "grad bucket 0")
    error = comm.flight._failure(record, RuntimeError("boom"))
    assert isinstance(error, RuntimeError) and error.record is record
    assert comm.flight_record()[-1].state == "failed"
    last = comm.flight_record(tmp_path / "flight-rank3.bin")[-1]
    assert (last.seq, last.state, last.completed) == (record.seq, "failed", None)


def test_not_a_flight_record_is_a_value_error(tmp_path) -> None:
    (tmp_path / "f.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a dtp flight record"):
        comm.flight_record(tmp_path / "f.bin")


@pytest.mark.parametrize("gloo, says", [
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
     "for recv operation to complete",
     "Timed out waiting 5000ms for recv operation to complete (a peer did not join it in time"),
    # a collective posted beside the one that timed out, on the same pair
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] Application timeout caused pair "
     "closure", "Application timeout caused pair closure (a peer did not join it in time"),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:3748: "
     "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
     "Check the logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f",
     "Read error [127.0.0.1]:3748: Connection reset by peer (a peer's process has ended). Last collectives here: "),
])
def test_collective_error_is_one_line_naming_rank_collective_and_record(gloo, says) -> None:
    """The messages gloo gives on torch 2.13 (measured) for a stalled and a dead peer."""
    record = comm.flight._record("all_reduce", "dp", 4096, 2, torch.ones(1024), False, "grad reduce")
    message = str(comm.flight._failure(record, RuntimeError(gloo)))
    assert "\n" not in message and "GLHF" not in message and "pair.cc" not in message
    assert message.startswith(f"rank 0: all_reduce over 'dp' (#{record.seq} 'grad reduce') failed ")
    assert says in message
    assert message.endswith(f"#{record.seq} all_reduce dp 'grad reduce' 4.1 kB failed")


def test_format_flight_record() -> None:
    entries = [comm.FlightEntry(i, "all_gather", "tp", "", 2_500_000, 0.0, 1.0) for i in (1, 2, 3, 4)]
    entries.append(comm.FlightEntry(5, "send_recv", "cp", "ring step 1", 10, 0.0, None))
    assert comm.format_flight_record(entries, last=2) == "#4 all_gather tp 2.5 MB done, #5 send_recv cp 'ring step 1' 10 B in flight"
    assert comm.format_flight_record(entries, last=0) == comm.format_flight_record([]) == "none"


def _p2p_under_link(compute_s: float) -> tuple[float, float, float]:
    # rank 0 sends 400 kB at once; rank 1 posts the receive, computes, then waits. Link:
    # 1 MB/s, so the modelled transfer takes 0.4 s on each side.
    mesh = dtp.make_mesh(pp=2)
    rank = dist.get_rank()
    with comm.simulated_link(bandwidth=1e6, axes=("pp",)), comm.comm_log() as log:
        t0 = time.perf_counter()
        if rank == 0:
            comm.send(torch.ones(100_000), mesh, "pp", to=1, key=7).wait()
        else:
            handle = comm.recv((100_000,), torch.float32, mesh, "pp", frm=0, key=7)
            time.sleep(compute_s)
            assert torch.equal(handle.wait(), torch.ones(100_000))
        rec = log.records[-1]
    return time.perf_counter() - t0, rec.waited, rec.completed - rec.issued


def test_point_to_point_transfers_are_seen_by_the_link_from_when_they_are_posted() -> None:
    # Both sides pay the transfer (before: the receiver never did, the sender only from wait()).
    (send_total, _, send_span), (recv_total, _, recv_span) = run(_p2p_under_link, 0.0, world_size=2)
    assert send_total >= 0.39 and send_span >= 0.39
    assert recv_total >= 0.39 and recv_span >= 0.39
    # Compute on the receiver longer than the transfer hides it: waiting costs (almost) nothing.
    _, (recv_total, recv_waited, _) = run(_p2p_under_link, 0.8, world_size=2)
    assert recv_waited < 0.2 and recv_total < 1.15


def _from_last_post(kind: str) -> tuple[float, float, float, bool]:
    # 16 MB under a link that moves it in 0.1 s; rank 1 posts 0.2 s after rank 0. Returns
    # (posted, completed) on perf_counter (CLOCK_MONOTONIC on Linux: the clock the ranks
    # share, as the board's), the modelled transfer's length, and whether the board's
    # file is gone once KEPT later contexts were entered.
    mesh = dtp.make_mesh(pp=2)
    rank = dist.get_rank()
    x = torch.ones(4_000_000)
    # Start together: the pool hands the call to its ranks one after the other, and under
    # load (CI beside other work) rank 0 began 53 ms after rank 1, so "0.2 s late" was 0.147.
    dist.barrier()
    with comm.simulated_link(bandwidth=16e6 / 0.1, axes=("pp",)), comm.comm_log() as log:
        board = comm.link._link_board()
        if rank == 1:
            time.sleep(0.2)
        if kind == "all_reduce":
            comm.all_reduce(x, mesh, "pp")
        elif rank == 0:
            comm.send(x, mesh, "pp", to=1, key=3).wait()
        else:
            comm.recv(x.shape, x.dtype, mesh, "pp", frm=0, key=3).wait()
        rec = log.records[-1]
    assert board is not None and board.path.exists()
    comm.barrier()  # the receiver has read the sender's entry: the sender's file may go
    for _ in range(comm.board.KEPT):
        with comm.simulated_link(bandwidth=1e9):
            pass
    return rec.issued, rec.completed, 0.1, not board.path.exists()


@pytest.mark.parametrize("kind", ["all_reduce", "recv"])
def test_link_starts_a_transfer_when_the_last_rank_posted_it(kind) -> None:
    # The posting board (dtp.comm.board): the modelled transfer starts when the last rank
    # posted (rank 1, 0.2 s late), not once the real 16 MB loopback transfer has finished
    # on top of that (several ms: before the board, completion came that much later).
    (post0, done0, length, gone0), (post1, done1, _, gone1) = run(_from_last_post, kind, world_size=2)
    assert post1 - post0 > 0.15
    receiver_done = done1 if kind == "recv" else max(done0, done1)
    assert abs(receiver_done - (post1 + length)) < 1e-3, (receiver_done - post1, length)
    if kind == "all_reduce":
        assert abs(done0 - done1) < 1e-3
    assert gone0 and gone1


def test_posting_board_matches_operations_across_ranks_and_says_unknown_when_an_entry_is_missing(
        tmp_path, monkeypatch) -> None:
    # Two boards of one run in one directory stand in for two ranks (no processes): the
    # n-th collective on a group, and the n-th message with a tag from one rank to the
    # other, find each other; a rank that has not written its entry reads as unknown
    # (None), which the link takes as "start when the real transfer has finished".
    from dtp.comm.board import Board

    class Group:
        group_name = "7"

    group = Group()
    boards = [Board(tmp_path, "run", 1, rank) for rank in (0, 1)]
    for b in boards:
        b._members["7"] = [0, 1]
    first = boards[0].collective(group, "all_reduce", 10.0)
    assert first() is None  # rank 1 has not posted it
    second = boards[1].collective(group, "all_reduce", 12.5)
    assert first() == second() == 12.5
    assert boards[0].collective(group, "all_reduce", 20.0)() is None  # the next one: rank 1 is not there yet
    # Out of step (rank 1 posts another kind there): unknown, not the other operation.
    assert boards[1].collective(group, "all_gather", 21.0)() is None
    monkeypatch.setattr(comm.board.dist, "get_rank", lambda g: boards.index(current))
    current = boards[1]
    arrival = boards[1].recv(group, 0, 5, 4096, 30.0)
    assert arrival() is None  # the sender's entry is missing
    current = boards[0]
    boards[0].send(group, 1, 4, 4096, 31.0)  # another tag: not this receive's message
    boards[0].send(group, 1, 5, 8, 32.0)  # another size: neither
    assert arrival() is None
    boards[0].send(group, 1, 5, 4096, 33.0)
    assert arrival() == 33.0
    with open(boards[0].path, "r+b") as f:  # a foreign or cut file reads as unknown
        f.truncate(16)
    fresh = Board(tmp_path, "run", 1, 1)
    fresh._members["7"] = [0, 1]
    assert fresh.collective(group, "all_reduce", 40.0)() is None


def _gloo_forms() -> list[tuple[str, bool, int]]:
    """Reduce-scatter and all-gather, waited at once and async (on gloo both are
    all-to-alls, written into ``out=`` for the gather), dims 0 and 1, on a 4-rank mesh's
    axes of 2 and 4 (ends and middle ranks), against the values computed here from every
    peer's known input, and the bytes against :func:`dtp.comm.ring_bytes`."""
    def x_of(rank: int, shape: tuple[int, int]) -> torch.Tensor:
        return torch.arange(float(shape[0] * shape[1]), dtype=torch.float64).reshape(shape) * (rank + 1) / 7

    mesh = dtp.make_mesh(a=2, b=2)
    flat = dtp.make_mesh(w=4)
    out = []
    for m, axis in ((mesh, "a"), (mesh, "b"), (flat, "w")):
        group = m.get_group(axis)
        peers, me, n = dist.get_process_group_ranks(group), group.rank(), group.size()
        x = x_of(dist.get_rank(), (8, 12))
        whole = sum(x_of(r, (8, 12)) for r in peers)
        for dim in (0, 1):
            expected = whole.chunk(n, dim)[me]
            with dtp.comm_log() as log:
                now = comm.reduce_scatter(x, m, axis, dim=dim)
                later = comm.reduce_scatter(x, m, axis, dim=dim, async_op=True).wait()
            ok = all(torch.allclose(t, expected, rtol=1e-14, atol=0) for t in (now, later))
            out.append((f"reduce_scatter {axis} dim {dim}", ok,
                        sum(r.bytes for r in log.records) - 2 * comm.ring_bytes("reduce_scatter", x.numel() * 8, n)))
            expected = torch.cat([x_of(r, (8, 12)) for r in peers], dim=dim)
            with dtp.comm_log() as log:
                now = comm.all_gather(x, m, axis, dim=dim)
                later = comm.all_gather(x, m, axis, dim=dim, async_op=True).wait()
            out.append((f"all_gather {axis} dim {dim}", torch.equal(now, expected) and torch.equal(later, expected),
                        sum(r.bytes for r in log.records) - 2 * comm.ring_bytes("all_gather", x.numel() * 8, n)))
        buf = torch.full((n * 8, 12), float("nan"), dtype=torch.float64)
        got = comm.all_gather(x, m, axis, out=buf, async_op=True).wait()
        out.append((f"all_gather {axis} out=", got is buf and torch.equal(buf, torch.cat(
            [x_of(r, (8, 12)) for r in peers])), 0))
    return out


def test_reduce_scatter_and_all_gather_on_gloo_give_every_peers_values_and_ring_bytes() -> None:
    # On gloo both run as all-to-alls (gloo's reduce-scatter never starts before wait()
    # and is slow waited at once; its all-gather stages a copy): checked against values
    # computed from every peer's input, not against each other.
    for rank in run(_gloo_forms, world_size=4):
        assert all(ok and bytes_diff == 0 for _, ok, bytes_diff in rank), rank


def test_simulated_link_with_neighbours_moves_both_ways_round_the_ring_at_once() -> None:
    # The model itself, no ranks: a 1 B/s link, so a 1000 B transfer books 1000 s. One link
    # a rank (the default) queues the hop to c - 1 behind the one to c + 1; a link to each
    # neighbour does not, while a second hop the same way still queues.
    from dtp.comm.link import _link_deadline

    with comm.simulated_link(bandwidth=1.0):
        first = _link_deadline("tp", 1000, route=1)
        assert first is not None and _link_deadline("tp", 1000, route=-1) == first + 1000
    with comm.simulated_link(bandwidth=1.0, neighbours=True):
        first = _link_deadline("tp", 1000, route=1)
        other_way = _link_deadline("tp", 1000, route=-1)
        assert first is not None and other_way is not None and other_way < first + 1000
        assert _link_deadline("tp", 1000, route=1) == first + 1000
        assert _link_deadline("tp", 1000, incoming=True, route=-1) < first + 1000  # incoming: its own queue


def test_a_posting_time_after_now_is_taken_as_now() -> None:
    # A start the board gives later than now could only be a clock gone wrong: taken as
    # now, so wait() never sleeps for it (1 B/s: a 1000 B transfer books 1000 s).
    from dtp.comm.link import _link_deadline

    with comm.simulated_link(bandwidth=1.0):
        before = time.perf_counter()
        end = _link_deadline("tp", 1000, start=before + 3600)
        assert end is not None and before + 1000 <= end <= time.perf_counter() + 1000
        assert _link_deadline("dp", 1000, start=before - 10) == pytest.approx(before + 990)


def _both_ways(coalesce: bool) -> dict:
    # Rank r sends r + 1 (10 + r) to c + 1 (c - 1): what arrives is its neighbours' values.
    # coalesce=True stands in for NCCL, whose batch comes back as one work for every op.
    mesh = dtp.make_mesh(tp=dist.get_world_size())
    n, me = mesh.size(0), mesh.get_local_rank(0)
    batches: list[int] = []
    real = dist.batch_isend_irecv

    class _One:  # every op of the batch behind one work that may be waited twice, as NCCL's
        def __init__(self, works):
            self.works = works  # (a gloo receive waited twice waits for a next message)
            self.waited = 0

        def wait(self):
            self.waited += 1
            for w in self.works:
                w.wait()
            self.works = []
            return True

        def is_completed(self):
            return not self.works

        def get_future(self):  # as gloo's send/recv: none (the handle takes completion at wait())
            raise RuntimeError("no future")

    ones: list[_One] = []

    def counted(ops):
        batches.append(len(ops))
        works = real(ops)
        if coalesce:
            ones.append(_One(works))
            return ones[-1:]
        return works

    dist.batch_isend_irecv = counted
    try:
        with dtp.comm_log() as log:
            right, left = comm.send_recv_batch([(torch.full((3,), me + 1.0), 1), (torch.full((2,), 10.0 + me), -1)],
                                               mesh, "tp", tag="both")
            # The second pair's handle first: with one coalesced work, it must wait for it too.
            got = (left.wait().tolist(), right.wait().tolist())
    finally:
        dist.batch_isend_irecv = real
    return dict(got=got, want=([10.0 + (me + 1) % n] * 2, [float((me - 1) % n + 1)] * 3), batches=batches,
                waited=[o.waited for o in ones], records=[(r.kind, r.axis, r.bytes, r.tag) for r in log.records])


@pytest.mark.parametrize("coalesce", [False, True], ids=["gloo", "coalesced"])
def test_send_recv_batch_posts_both_directions_as_one_batch(coalesce: bool) -> None:
    for rank in run(_both_ways, coalesce, world_size=4):  # a ring whose two neighbours differ
        assert rank["got"] == rank["want"], rank
        assert rank["batches"] == [4], rank  # both directions' send and receive, one call
        assert rank["waited"] == ([2] if coalesce else []), rank  # each handle waited the one work
        assert rank["records"] == [("send_recv", "tp", 12, "both"), ("send_recv", "tp", 8, "both")], rank
