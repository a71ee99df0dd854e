"""The spine: run(spec) -> manifest (spine.py), and what a run records, shows and handles on the way."""
