"""Lamina (seed 003): attention workers in processes of their own, reached over the DistKV
data plane (scheduler/distkv/channel.py).

- worker_process.py: an attention worker's process (an AttentionWorker behind a
  KVChannelServer) and how a model worker starts one;
- launcher.py: ProcessWorkers, the engine's attention-worker launcher for those processes;
- ray_workers.py: RayWorkers, a Ray runner's launcher: each worker a detached Ray actor, so
  that it outlives its model worker;
- rescue.py: a dead model worker's requests' KV, read off its attention workers.
"""
