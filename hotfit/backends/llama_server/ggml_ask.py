"""Ask a portable llama.cpp build's own ggml which backend modules it loads on this machine and what
each reports; run as a child process: ``python3 ggml_ask.py BIN_DIR``.

Why not ``llama-server -v --list-devices``: llama-server logs ggml's lines ("load_backend: loaded
CPU backend from .../libggml-cpu-zen4.so", ggml-cuda's "Device 0: ..., compute capability 9.0")
through llama.cpp's logger, whose worker thread the immediate exit() may beat — the logger is
leaked on purpose (llama.cpp's common/log.cpp) — so on a loaded machine the lines can be lost. Here
the build's libggml loads its modules from BIN_DIR with ggml's own scoring, exactly as llama-server
does, and ggml's default logger writes each line to stderr as it happens. Then one line per
backend on stdout: its name and features, as llama-server's system_info writes them
(``CUDA : ARCHS = 750,860 | USE_GRAPHS = 1``).

Standard library only: ``scripts/install-llama-server`` runs it with the system python3, before
the virtualenv exists. Exit 3 when the build has no ``libggml.so.0`` (not a portable build).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path


class _Feature(ctypes.Structure):  # ggml-backend.h: struct ggml_backend_feature
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


def main(bin_dir: Path) -> int:
    library = bin_dir / "libggml.so.0"
    if not library.is_file():
        print(f"ggml_ask: no {library} (not a portable build)", file=sys.stderr)
        return 3
    ggml = ctypes.CDLL(str(library))
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load_all_from_path.restype = None
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_reg_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    get_features_type = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)

    ggml.ggml_backend_load_all_from_path(str(bin_dir).encode())
    for i in range(ggml.ggml_backend_reg_count()):
        reg = ggml.ggml_backend_reg_get(i)
        name = (ggml.ggml_backend_reg_name(reg) or b"?").decode(errors="replace")
        pairs = []
        address = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
        if address:
            features = get_features_type(address)(reg)
            j = 0
            while features and features[j].name:
                pairs.append(f"{features[j].name.decode(errors='replace')} = "
                             f"{(features[j].value or b'').decode(errors='replace')}")
                j += 1
        print(f"{name} : {' | '.join(pairs)}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: ggml_ask.py BIN_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1])))
