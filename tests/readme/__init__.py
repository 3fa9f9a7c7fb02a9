"""The README, executed: its code blocks run against a real fleet (see tests/readme/blocks.py)."""
