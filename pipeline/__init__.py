"""The top of hotfit: the generic stage engine (engine), hotfit's stage table and adapters (provision,
session_stages), the ``auto`` and ``pull`` jobs built on them (auto, pull), the manifest, the serving
worker record, the registry lock's Hub effects, and the command line (cli, which only parses and
renders)."""
