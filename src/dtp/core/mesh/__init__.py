"""Meshes: named device meshes, device and backend detection and process-group set-up
(:mod:`.devices`: ``dtp.make_mesh``), a mesh's shape without torch (:mod:`.shape`: what
the CLI checks a layout against), and local ranks started the torchrun way
(:mod:`.launch`).

Nothing is imported here: :mod:`.shape` serves the CLI before torch is loaded.
"""
