"""Pipeline schedules as data: one list of actions per pipeline rank, no torch.

actions.py (Action, Pair, Schedule, the stage map), build.py (:func:`make`, :func:`check`),
v.py (zbv, dualpipev), simulate.py (:func:`dependencies_ok`, :func:`lane_pairs`,
:func:`simulate`, :func:`format_schedule`).

A schedule is a tuple with one action list per pipeline rank ``0..p-1``. The runner
executes each rank's list in order; a send never blocks and a receive waits only for
the data it needs, so a schedule is valid when some global order of all actions is
consistent with every rank's list (:func:`dependencies_ok`). Rank ``r`` holds the
``v`` virtual chunks ``r, r+p, ..., r+(v-1)p`` of the ``p·v`` global stages
(Megatron's round-robin, placement ``"loop"``); under the V schedules (zbv, dualpipev,
placement ``"v"``) rank ``r`` holds two chunks, stages ``r`` and ``2p-1-r``, so the
first and the last stage sit on rank 0. The placement is the schedule's data
(:class:`Schedule`); an :class:`Action` names its chunk and microbatch, and
:meth:`Action.stage` gives its global stage. A :class:`Pair` is DualPipeV's ``F&B``: one
microbatch's forward and another's backward, their transfers posted together so one's
is in flight while the other computes.

Action kinds: ``F`` forward; ``B`` full backward (input and weight grads); ``I``
input-grad only; ``W`` weight-grad only (``I`` then ``W`` is zero bubble's split ``B``).

=============  ===========================  ==========================  ==================
schedule       warm-up forwards on rank r   bubble ratio (f=1, b=2)     peak in flight
=============  ===========================  ==========================  ==================
gpipe          all m, then all m backwards  (p-1)/m                     m
1f1b           p-r-1 (PipeDream-flush)      (p-1)/m                     p-r
interleaved    2(p-r-1) + (v-1)p, ≤ m·v     (p-1)/(v·m)                 warm-up + 1
zb-h1          p-r-1; rank r defers r W's   (p-1)/(3m) at I = W = f     p
zbv            2(p-r)-1 chunk-0 forwards    (p-1)/(6m) at f = I = W     2p chunks (= p)
dualpipev      2(p-r-1) F0, r+1 F0F1        (p-1)/(3m) at f = I = W     2p+1 chunks
=============  ===========================  ==========================  ==================

(zbv's and dualpipev's costs are per chunk, half a 1f1b stage's: zbv's 2p chunks of
activations are p stages' worth, 1f1b's rank-0 peak; dualpipev's 2p+1 are DeepSeek's
PP+1 with PP = 2p stages. :mod:`dtp.schedules.v` derives both bubbles.)

(Interleaved's peak counts (chunk, microbatch) pairs: its warm-up plus one, at most m·v.)

Two normalisations of the bubble are reported by :func:`simulate`: ``bubble_fraction``
is idle time over all ranks' time, ``1 - busy / (p · makespan)`` (gpipe and 1f1b:
``(p-1)/(m+p-1)``), and ``bubble_ratio`` is idle time over compute time,
``(p · makespan - busy) / busy`` (the papers' ``(p-1)/m``). Peak in flight counts the
(chunk, microbatch) pairs whose activations a rank holds: ``F`` done, its ``B`` or ``W``
not yet; for ``v = 1`` that is microbatches.

Where the schedules come from (facts learnt, code our own): GPipe (Huang et al. 2019);
1F1B is PipeDream-flush (Narayanan et al. 2021); interleaved is Megatron-core's
``forward_backward_pipelining_with_interleaving`` (virtual microbatch ``k`` runs chunk
``(k mod p·v) // p`` on microbatch ``(k // p·v)·p + k mod p``, backwards walk the chunks
in reverse); zb-h1 is zero bubble's handcrafted H1 (Qi et al. 2023), whose rank ``r``
holds back ``r`` weight-grads in the steady state to fill its cool-down bubble, so its
peak memory stays at 1f1b's rank-0 peak of ``p`` microbatches; zbv is the V schedule of
zero bubble's "controllable memory" paper (Qi et al. 2024), dualpipev DeepSeek's
DualPipeV (DeepSeek-V3 report; github.com/deepseek-ai/DualPipe), see
:mod:`dtp.schedules.v`.
"""

from __future__ import annotations

from .actions import (PLACEMENTS, SCHEDULES, V_SCHEDULES, Action, Pair, Schedule, chunks_per_rank, global_stage,
                      placement, stage_owner)
from .build import check, default_microbatches, fewest_microbatches, forward_only, least_microbatches, make
from .simulate import Event, Timeline, dependencies_ok, format_schedule, lane_pairs, simulate

__all__ = [
    "SCHEDULES",
    "V_SCHEDULES",
    "PLACEMENTS",
    "Action",
    "Pair",
    "Schedule",
    "placement",
    "chunks_per_rank",
    "Event",
    "Timeline",
    "check",
    "make",
    "least_microbatches",
    "fewest_microbatches",
    "default_microbatches",
    "forward_only",
    "dependencies_ok",
    "lane_pairs",
    "simulate",
    "global_stage",
    "stage_owner",
    "format_schedule",
]
