"""One runner's engine: the step loop (engine.py: schedule -> plan -> model -> sample ->
postprocess) and its parts: a request's refusals (checks.py), the step's sampling isolated
per request (step_sampling.py), a token's way out as an output (outputs.py), and a request
moving between runners (moves.py)."""

from punica_x.engine.checks import check_request
from punica_x.engine.engine import Engine

__all__ = ["Engine", "check_request"]
