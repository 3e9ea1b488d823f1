"""From logits to what a caller reads: sampling with every SamplingParams feature
(sampler.py), logprobs (logprobs.py), JSON-schema constrained decoding (structured.py) and
incremental text with stop strings (detokenizer.py)."""
