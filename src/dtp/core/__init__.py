"""dtp's DTensor layer, which every other part builds on: JAX-style partition specs
(:mod:`.spec`: ``P``, ``shard``), moving a tensor between them (:mod:`.redistribute`:
``reshard``, ``local_map``), named meshes and where ranks come from (:mod:`.mesh`), every
collective with its log (:mod:`.comm`), pictures of a layout (:mod:`.visualization`), and
the rules and private torch APIs the layers share (:mod:`._rules`, :mod:`._torch`).

Nothing is imported here: the torch-free modules (``_rules``, ``mesh.shape``) serve the
CLI's checks before torch is loaded.
"""
