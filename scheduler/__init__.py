"""Cluster control plane: placement, migration, MLFQ, gManager (see DESIGN.md)."""
