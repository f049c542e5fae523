"""The `lightning-ray` command (app.py) and the jobs it runs (jobs.py)."""
