"""The runners the scheduler drives, behind one RunnerHandle (interface.py): a thread in this
process (local.py) or a Ray actor (ray_runner.py, its process side ray_actor.py, the events
between them ray_events.py), and which device each serves from (devices.py)."""
