"""TLS for the ext_proc port: certificate material from `server.tls`, reloaded when the
files change, as an `ssl.SSLContext` (our asyncio transport) or grpcio server credentials.

The reference picker (gateway-api-inference-extension v1.5.0 `pkg/epp/server/options.go`
`--secure-serving`, default on; `pkg/common/certs.go` reloads `--cert-path` on change;
`pkg/common/tls/certs.go` makes a self-signed certificate when no path is given) is the
model. Ours: `cert_file`/`key_file` instead of a directory, polled with `os.stat` every
`reload_interval_s` (a Kubernetes Secret volume swaps a symlink, which changes the
target's inode and mtime), an ECDSA P-256 self-signed certificate (the reference uses RSA
4096: slower to make, no different to Envoy, which does not validate it in the gateways
that use TLS), and optional client certificates (mTLS) from `client_ca_file`.
New connections get the current certificate; open ones keep theirs. A reload that fails
(files half-written, key not matching) keeps the previous certificate and is counted.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import ssl
import tempfile
from pathlib import Path

import grpc
from prometheus_client import Counter

from scorer.config import ConfigError, TlsConfig

log = logging.getLogger("scorer.extproc.tls")

TLS_HANDSHAKE_FAILURES = Counter(
    "kv_scorer_tls_handshake_failures_total",
    "ext_proc port TLS handshakes that failed (asyncio transport), by reason: "
    "certificate (the peer rejected ours or sent none/a bad one), protocol, timeout.",
    ["reason"],
)
TLS_RELOADS = Counter(
    "kv_scorer_tls_certificate_reloads_total",
    "ext_proc certificate reloads after cert_file/key_file changed, by result.",
    ["result"],
)


def self_signed(common_name: str = "kv-scorer") -> tuple[bytes, bytes]:
    """A self-signed server certificate and its key (PEM), valid 10 years, like the
    reference picker's `CreateSelfSignedTLSCertificate` (ECDSA P-256 here)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kv-scorer"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert_pem, key_pem


def server_context(cert_pem: bytes, key_pem: bytes, ca_pem: bytes | None) -> ssl.SSLContext:
    """A server SSLContext from PEM bytes: TLS 1.2+, ALPN h2, client certificates
    required when a CA is given. Raises ssl.SSLError / ValueError on bad material."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # HTTP/2 over TLS needs ALPN h2 (RFC 9113 §3.2); gRPC clients offer only h2.
    ctx.set_alpn_protocols(["h2"])
    # load_cert_chain reads files only: write the PEM to a private temporary directory.
    with tempfile.TemporaryDirectory() as d:
        c, k = Path(d, "tls.crt"), Path(d, "tls.key")
        c.write_bytes(cert_pem)
        k.touch(mode=0o600)
        k.write_bytes(key_pem)
        ctx.load_cert_chain(c, k)
    if ca_pem is not None:
        ctx.load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _stat(path: str) -> tuple[int, int, int]:
    st = os.stat(path)  # follows symlinks: a Secret volume's ..data swap shows here
    return st.st_ino, st.st_mtime_ns, st.st_size


class TlsMaterial:
    """The ext_proc port's certificate, key and client CA. Build it at start-up (raises
    ConfigError naming the field), `start()` the reload poll, `stop()` it."""

    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self.ca_pem: bytes | None = None
        if config.client_ca_file is not None:
            self.ca_pem = _read(config.client_ca_file, "server.tls.client_ca_file")
        self.self_signed = config.cert_file is None
        self._stamp: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None
        if config.cert_file is None or config.key_file is None:
            self.cert_pem, self.key_pem = self_signed()
        else:
            self.cert_pem = _read(config.cert_file, "server.tls.cert_file")
            self.key_pem = _read(config.key_file, "server.tls.key_file")
            self._stamp = (_stat(config.cert_file), _stat(config.key_file))
        _check_pem(self.cert_pem, self.key_pem, self.ca_pem)
        try:
            self.context = server_context(self.cert_pem, self.key_pem, self.ca_pem)
        except (ssl.SSLError, ValueError) as e:
            raise ConfigError(
                f"server.tls.cert_file / server.tls.key_file: not a usable pair: {e}"
            ) from e
        self.generation = 0  # bumped on every successful reload
        self.reloaded = asyncio.Event()  # set on each reload (tests clear and wait on it)
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ reload

    def check(self) -> bool:
        """Reload when cert_file or key_file changed. Returns True after a reload; a
        failed reload keeps the current certificate (logged, counted)."""
        cfg = self.config
        if cfg.cert_file is None or cfg.key_file is None:
            return False
        try:
            stamp = (_stat(cfg.cert_file), _stat(cfg.key_file))
        except OSError as e:
            log.warning("TLS certificate files unreadable, keeping the current one: %s", e)
            TLS_RELOADS.labels("error").inc()
            return False
        if stamp == self._stamp:
            return False
        try:
            cert = Path(cfg.cert_file).read_bytes()
            key = Path(cfg.key_file).read_bytes()
            ctx = server_context(cert, key, self.ca_pem)
        except (OSError, ssl.SSLError, ValueError) as e:
            # Likely a rotation half done (cert written, key not yet): try again next
            # poll, since the stamp is not recorded.
            log.warning("TLS certificate reload failed, keeping the current one: %s", e)
            TLS_RELOADS.labels("error").inc()
            return False
        self._stamp = stamp
        self.cert_pem, self.key_pem, self.context = cert, key, ctx
        self.generation += 1
        self.reloaded.set()
        TLS_RELOADS.labels("ok").inc()
        log.warning("TLS certificate reloaded from %s", cfg.cert_file)
        return True

    async def start(self) -> None:
        """Poll the files every `reload_interval_s` (nothing to poll when self-signed)."""
        if self._task is None and not self.self_signed:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.reload_interval_s)
            try:
                self.check()
            except Exception:  # the poll must survive anything a file system does
                log.exception("TLS certificate check failed")

    # ------------------------------------------------------------ for the servers

    def ssl_context(self) -> ssl.SSLContext:
        """The context for a new connection (asyncio transport)."""
        return self.context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """grpcio server credentials that pick up reloads on the next handshake."""
        seen = self.generation

        def config() -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration(
                [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem
            )

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # Called by grpcio on each new handshake: None keeps the current certificate.
            nonlocal seen
            if self.generation == seen:
                return None
            seen = self.generation
            return config()

        return grpc.dynamic_ssl_server_credentials(
            config(),
            fetch,  # type: ignore[arg-type]  # grpcio documents None as "no change"
            require_client_authentication=self.ca_pem is not None,
        )


def _read(path: str, field: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{field}: {path}: {e.strerror or e}") from e
    if not data.strip():
        raise ConfigError(f"{field}: {path}: empty file")
    return data


def _check_pem(cert: bytes, key: bytes, ca: bytes | None) -> None:
    """Parse each PEM so that a bad one is named (OpenSSL's own errors do not say which
    file they are about)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    for field, data in (("cert_file", cert), ("client_ca_file", ca)):
        if data is None:
            continue
        try:
            x509.load_pem_x509_certificates(data)
        except ValueError as e:
            raise ConfigError(f"server.tls.{field}: not a PEM certificate: {e}") from e
    try:
        serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"server.tls.key_file: not an unencrypted PEM private key: {e}") from e
