"""The one trust store for hotfit's downloads: the one huggingface_hub's own requests use.

huggingface_hub ≥ 2 talks through httpx2, whose default context is ``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` when set, else the system's store (OpenSSL's default paths: ``/etc/ssl/certs``
on Debian, filled by ``update-ca-certificates``). httpx's default is certifi's bundle, so a mirror
behind a private CA added to the system store answered ``registry lock`` (huggingface_hub) and
failed ``pull`` (hotfit's engine). Both now read the same store (docs/network.md, "TLS").
"""

from __future__ import annotations

import os
import ssl

__all__ = ["CA_FILE_CANDIDATES", "tls_context"]

# Where distributions keep the system bundle, for a Python whose OpenSSL paths point nowhere
# (the list httpx2 and truststore fall back to on Linux)
CA_FILE_CANDIDATES = (
    "/etc/ssl/cert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/pki/tls/cert.pem",
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/ssl/ca-bundle.pem",
)


def tls_context(environ: os._Environ[str] | dict[str, str] | None = None) -> ssl.SSLContext:
    """A client context trusting what huggingface_hub trusts (module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    if env.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=env["SSL_CERT_DIR"])
    paths = ssl.get_default_verify_paths()
    cafile = paths.openssl_cafile if os.path.isfile(paths.openssl_cafile) else None
    capath = paths.openssl_capath if os.path.isdir(paths.openssl_capath) else None
    if cafile is None and capath is None:
        cafile = next((c for c in CA_FILE_CANDIDATES if os.path.isfile(c)), None)
    context = ssl.create_default_context(cafile=cafile, capath=capath) if cafile or capath else None
    if context is None:  # no system store at all: the bundle httpx ships with (certifi)
        import certifi

        context = ssl.create_default_context(cafile=certifi.where())
    return context

