"""The PEM files TLS is configured with, read and checked before grpc is given them: grpc
takes any bytes as credentials and fails later (a listener that cannot bind, a channel whose
every call fails) with no word of which file is wrong. Python's ssl reads them as OpenSSL
will: a certificate and the key that goes with it, and CA certificates. Used by kvd for its
listener and its peers, and by the clients."""

from __future__ import annotations

import ssl


def read_pem(files: dict[str, str | bytes | None], *, server: bool
             ) -> dict[str, bytes | None]:
    """The bytes of each file (name -> path, or the PEM bytes themselves; "" or None for
    none), checked. Each name ends in its role, `ca`, `cert` or `key` (e.g. tls_client_ca),
    and is how an error names the file: a certificate must go with its unencrypted key, a
    CA file must hold a certificate. ValueError saying which file is wrong otherwise."""
    pem: dict[str, bytes | None] = {}
    for name, value in files.items():
        if not value or isinstance(value, bytes):
            pem[name] = value or None
            continue
        try:
            with open(value, "rb") as f:
                pem[name] = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read {name} {value}: {exc.strerror}") from None
    role = {name.rsplit("_", 1)[-1]: name for name in files}
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    cert, key, ca = (role.get(r, "") for r in ("cert", "key", "ca"))
    if isinstance(files.get(cert), str) and isinstance(files.get(key), str) and files[cert]:
        try:  # from files only: ssl reads no certificate chain from memory
            # No password: grpc takes no encrypted key, and ssl would ask for one on the tty.
            context.load_cert_chain(files[cert], files[key], password=_no_password)
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"{cert} {files[cert]} and {key} {files[key]} are not a PEM "
                             f"certificate and the unencrypted key that goes with it "
                             f"({exc})") from None
    if pem.get(ca) is not None:
        try:
            context.load_verify_locations(cadata=pem[ca].decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            shown = files[ca] if isinstance(files[ca], str) else "(bytes given)"
            raise ValueError(f"{ca} {shown} holds no PEM certificate ({exc})") from None
    return pem


def _no_password() -> str:
    raise ValueError("the key is encrypted")
