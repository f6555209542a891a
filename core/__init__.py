"""Leaves every layer shares: the error tree, structured logging, settings, the registry entry and plan types,
and the ISA feature names. Nothing here imports any other hotfit package."""
