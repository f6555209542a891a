"""One module per stage of the pipeline (probe, plan, fetch_weights, fetch_template, verify, load,
probe_tool_call, recheck, grade), each a thin effectful step around the pure core below it; the
bounded GGUF header reader (``_gguf_header``) and the OpenVINO snapshot verifier
(``_snapshot_verify``) are verify's private helpers. Stages import backends, download and the pure
layers, never ``pipeline``."""
