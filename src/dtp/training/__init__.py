"""Training as a pure function: the state (:mod:`.state`: ``TrainState``), the step
(:mod:`.step`: ``train_step``, ``shard_batch``), the state no gradient trains
(:mod:`.buffers`), the ranks' agreement before they compute (:mod:`.guard`), the
compiled step (:mod:`.compiled`), the optimizer (:mod:`.optim`, optax-style, and
:mod:`.leafwise`: its work over a tree's local shards) and pictures of a run
(:mod:`.plot`).

Nothing is imported here: ``dtp.TrainState``, ``dtp.train_step`` and the rest are
re-exported (lazily) by :mod:`dtp`.
"""
