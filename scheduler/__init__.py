"""Cluster control plane (placement, migration, MLFQ, gManager): see DESIGN.md; grows with its issues."""
