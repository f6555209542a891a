"""What hotfit keeps on disk between runs: stage state (``store``, SQLite), download and model-file
receipts (``receipts``), process locks (``locks``) and atomic file writes (``files``)."""
