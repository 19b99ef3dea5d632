"""The cluster's ZeroMQ links: each component binds one inbox (PULL) and connects outboxes (PUSH) to the others'.

Plans, activations and sampled tokens cross these links, so whoever can connect to an endpoint can drive the stages
or read a conversation. On one host the endpoints are `ipc://` sockets in the launcher's private run directory.
Across hosts they are `tcp://`, and then every link is CurveZMQ: encrypted, and authenticated both ways with the
cluster's one certificate (`moepipe keys` writes it; the cluster config's `link_keys` names its secret file, which
every process of the cluster reads). A bound inbox answers only clients that present that certificate's public key
(a ZAP handler, one per process), and a connecting outbox checks that the inbox holds its secret half, so a host
that does not have the secret file can neither send nor listen. `ClusterConfig.validate` refuses tcp endpoints
without keys unless `insecure_links` says so.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SECRET_FILE = "cluster.key_secret"


class LinkKeyError(ValueError):
    """The certificate named by `link_keys` cannot be used."""


@dataclass(frozen=True)
class LinkKeys:
    public: bytes    # z85
    secret: bytes

    @classmethod
    def load(cls, path: str | Path) -> LinkKeys:
        path = Path(path)
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise LinkKeyError(f"link_keys {path}: cannot read a CurveZMQ certificate ({exc}); write one with "
                               f"`moepipe keys --out DIR`") from None
        if secret is None:
            raise LinkKeyError(f"link_keys {path}: holds only a public key; name the secret file "
                               f"({SECRET_FILE}) that `moepipe keys` wrote")
        return cls(public, secret)


def write_keys(out_dir: str | Path) -> Path:
    """A new cluster certificate in `out_dir` (created, private to the user); returns the secret file's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = out / SECRET_FILE
    if secret.exists():
        raise FileExistsError(f"{secret} exists: every process of a cluster must share one certificate, so an "
                              f"existing one is not replaced (remove it first to rotate the keys)")
    _, secret_path = zmq.auth.create_certificates(out, "cluster")
    Path(secret_path).chmod(0o600)
    return Path(secret_path)


_auth_lock = threading.Lock()
_authenticators: dict[int, ThreadAuthenticator] = {}


class _OnlyOurs:
    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def _authenticate(ctx: zmq.Context, keys: LinkKeys) -> None:
    """Start this context's ZAP handler once: inboxes accept only clients with the cluster's public key."""
    with _auth_lock:
        if id(ctx) in _authenticators:
            return
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_OnlyOurs(keys.public))
        _authenticators[id(ctx)] = auth


def stop_authentication(ctx: zmq.Context) -> None:
    """Stop the context's ZAP handler (before `ctx.term()`)."""
    with _auth_lock:
        auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()


def bind_inbox(ctx: zmq.Context, endpoint: str, keys: LinkKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    if keys is not None:
        _authenticate(ctx, keys)
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
        sock.curve_server = True
    sock.bind(endpoint)
    return sock


def connect_outbox(ctx: zmq.Context, endpoint: str, keys: LinkKeys | None, *, sndhwm: int | None = None,
                   sndtimeo: int | None = None, immediate: bool = False) -> zmq.Socket:
    """A PUSH socket to `endpoint`'s inbox. With `immediate`, messages queue only on a live connection: what was
    queued for a peer that died is dropped with it, not delivered to the process that binds the endpoint next, and
    a send finds no peer (blocks up to `sndtimeo`, or raises zmq.Again) until one is connected."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    if sndtimeo is not None:
        sock.setsockopt(zmq.SNDTIMEO, sndtimeo)
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
        sock.curve_serverkey = keys.public
    sock.connect(endpoint)
    return sock


def cluster_keys(link_keys: str) -> LinkKeys | None:
    """The keys a cluster config names (`link_keys`), or None for unencrypted links."""
    return LinkKeys.load(link_keys) if link_keys else None
