"""The top of hotfit: the generic stage engine (engine), the order of hotfit's stages (provision,
session_stages; each stage declares itself in stages/), the ``auto`` and ``pull`` jobs built on them
(auto, pull), the manifest, the serving worker record, the registry lock's Hub effects, and the
command line (cli, which only parses and renders)."""
