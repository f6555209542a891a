"""hotfit: provision, unattended, the best local LLM a machine can run as a tool-calling agent.

The one installed import package. Its layers are the folders here (core/, registry/, state/,
grading/, download/, backends/, stages/, pipeline/); the repository's top-level names link to them,
so a traceback's path is the one git keeps (CONTRIBUTING.md, "Layout").
"""
