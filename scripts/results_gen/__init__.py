"""The results tables' generators, by topic; `scripts/results_tables.py` names each table and
writes them into the markdown files."""
