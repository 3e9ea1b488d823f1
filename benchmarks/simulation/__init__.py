"""The cluster simulator's parts (benchmarks/cluster_sim.py runs them): step costs, a
simulated runner and cluster over the live policy code, and one module per experiment."""
