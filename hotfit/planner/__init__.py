"""The planner, pure (no I/O, no subprocess, no network; an import-linter contract says so): what
the probe saw (probe.py), the plan and where the model is placed (plan.py: ``Plan``, ``Placement``,
the one decoder of the plan's record), the one ranking of candidates and the "wins by …" it explains
(rank.py), the pick on one device (select.py), the choice across every device (devices.py) and the
``hotfit plan --json`` document of it (document.py).

The arithmetic the choice rests on — budget, KV bytes, one candidate's verdict, the refusal — is
registry/'s; what a backend serves is asked by the plan stage (stages/plan.py) and passed in as data.
"""
