"""`pdserve simulate`: a deployment's AgentX replay on a virtual clock, from the production scheduling code and a
calibration profile (cli.py, system.py, engines.py, profile.py, clock.py)."""
