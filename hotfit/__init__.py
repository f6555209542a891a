"""hotfit: provision, unattended, the best local LLM a machine can run as a tool-calling agent.

The one installed import package. Its layers are the repository's top-level folders (core/,
registry/, state/, grading/, download/, backends/, stages/, pipeline/), linked here so that a
checkout and an installed wheel import the same names (CONTRIBUTING.md, "Layout").
"""
