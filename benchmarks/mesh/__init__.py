"""Meshes: the collectives of sharded layers, checkpoints resumed across meshes."""
