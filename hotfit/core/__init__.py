"""Leaves every layer shares: the error tree (errors), structured logging (log), settings, the registry
entry type (entry), the fetch/verify results (model_files), the one decoding toolkit every file
format and stage record uses (records), and ISA feature names (isa). Nothing here imports
any other hotfit package."""
