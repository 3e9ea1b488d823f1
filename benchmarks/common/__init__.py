"""What the benchmark scripts share; no script imports another, each imports from here.

- report: the machine (CPU, ISA, torch, GPU), tables, JSON and PNG files under results/
- timing: a callable's median over repeats, copy and read bandwidth, percentiles
- args: the command-line flags several scripts have, each with the script's own default
- workload: chat prompts, rank-r adapters, the popularity workloads and their adapter names
- engine_timing: punica-x's tokens/s on a batch and its decode step time
- hf_baselines: HF transformers + PEFT generating the same batches (mixed, one at a time)
- server: `punica-x serve` on a free port with a tenant holding the adapters
- peers: vLLM CPU in a virtual environment of its own (engine runs, server, serving client)
- oracle: the SRPT batcher with every output length known (the bound MLFQ is measured to)

Scripts run as `python benchmarks/<script>.py`, so benchmarks/ is on sys.path and they
import `from common.<module> import ...`. peers.py also runs as a script inside the peer venv
(it imports only the standard library there).
"""
