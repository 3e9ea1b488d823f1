"""Continuous batching on one runner: which requests run each step (batcher.py: FCFS with
chunked prefill and preemption; batcher_mlfq.py: skip-join MLFQ over mlfq.py's pure levels,
with step_time.py's cost model), and the step's plan for the model (planner.py)."""
