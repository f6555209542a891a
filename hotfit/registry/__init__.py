"""The curated registry and the planner's arithmetic, pure (no network, no file I/O): the entry
schema and its one decoder (schema.py), the registry document (catalog.py; files are read by
pipeline/registry_file.py), KV bytes per token (kv.py), a device's budget (budget.py), one
candidate's verdict (verdict.py), the fail-closed refusal (refusal.py), and their one import surface
(select.py). The pick itself is the planner's (planner/)."""
