"""A process group of its own for weight broadcasts, beside whatever groups the process already has.

Members meet by TCP rendezvous at master_address:master_port (rank 0 hosts the store) under a store
prefixed by the group name: the `init_custom_process_group` pattern of OpenRLHF, slime and AReaL, so a
trainer that joins that way talks to this engine unchanged. The default group (torchrun's) is neither
created nor touched. Every wait is bounded by `timeout`: a peer that never comes is a TimeoutError.

Trust (docs/security.md): whoever reaches the port can join the group and send weights. The host
listens on master_address only, not on every interface. With a shared secret (`secret=` or the
ROLLOUT_WEIGHT_SYNC_SECRET variable) on every member, each proves it knows the secret by an HMAC
challenge through the store before the group forms, both ways; a wrong or missing one is a
PermissionError on both sides.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout.weights.bucket import FlattenedBucket, TensorMeta, empty_buffer, layout, total_bytes

DEFAULT_TIMEOUT_S = 300.0
SECRET_ENV = "ROLLOUT_WEIGHT_SYNC_SECRET"
# how long a member without a secret waits for the host to say whether it wants one: a host that is
# not rollout's never says, and must not cost more than this
HOST_MODE_WAIT_S = 1.0


@dataclass
class UpdateGroup:
    name: str
    pg: Any  # torch.distributed ProcessGroup
    rank: int
    world_size: int
    backend: str
    device: torch.device  # where broadcast tensors are received


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_backend(backend: str, device: torch.device) -> torch.device:
    """The device broadcasts use for this backend: NCCL needs a CUDA device, gloo works on the CPU."""
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"backend='nccl' needs a CUDA device, this side is on {device}; use 'gloo'")
        return device
    if backend == "gloo":
        return torch.device("cpu")
    raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    *,
    device: torch.device,
    timeout: float = DEFAULT_TIMEOUT_S,
    secret: str | bytes | None = None,
) -> UpdateGroup:
    """Join (rank 0: host) the group; returns once every member has joined, or raises TimeoutError.
    `secret` (default: $ROLLOUT_WEIGHT_SYNC_SECRET): members must all know it (PermissionError if not)."""
    _check_args(master_address, master_port, rank, world_size, group_name, timeout)
    recv_device = check_backend(backend, device)
    key = _secret(secret)
    td = timedelta(seconds=timeout)
    where = f"weights update group {group_name!r} (rank {rank} of {world_size}, tcp://{master_address}:{master_port})"
    auth = None
    try:
        # Our own TCPStore rather than dist.rendezvous: under torchrun, rendezvous would reuse the
        # elastic agent's store and no one would host this one.
        store = _store(master_address, master_port, rank, world_size, td)
        store.set_timeout(td)
        auth = dist.PrefixStore(f"{group_name}/rollout-auth", store)
        _check_secret(auth, group_name, rank, world_size, key)
        cuda = torch.cuda.device(device) if backend == "nccl" else contextlib.nullcontext()
        with cuda, _no_split_from_default_group():
            pg, _ = dist.distributed_c10d._new_process_group_helper(
                world_size,
                rank,
                [],
                dist.Backend(backend),
                dist.PrefixStore(group_name, store),
                group_name=group_name,
                timeout=td,
            )
    except PermissionError as e:
        raise PermissionError(f"{where}: {e}") from None
    except RuntimeError as e:  # DistStoreError, DistNetworkError
        if _is_timeout(e):
            mismatch = auth is not None and _secret_mismatch(auth, rank, world_size, key)
            if mismatch:
                raise PermissionError(f"{where}: {mismatch}") from e
            raise TimeoutError(f"{where}: peers did not all join within {timeout:g}s ({e})") from e
        raise RuntimeError(f"{where}: could not be created: {e}") from e
    dist.distributed_c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return UpdateGroup(group_name, pg, rank, world_size, backend, recv_device)


def _store(address: str, port: int, rank: int, world_size: int, td: timedelta) -> dist.TCPStore:
    if rank != 0:
        return dist.TCPStore(address, port, world_size, is_master=False, timeout=td)
    # TCPStore's server would listen on every interface whatever the host name; a socket bound to
    # `address` and handed over makes it listen there only. The group waits for its members itself.
    sock = _listen(address, port)
    try:
        store = dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            timeout=td,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the file descriptor now
    return store


def _listen(address: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"master_address {address!r} does not resolve: {e}") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: rebind after a restart
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {address}:{port}: {e}") from e
    return sock


# -- the shared secret ----------------------------------------------------------------------------
# Through the group's store, under its own prefix: the host posts a fresh nonce; each member posts
# whether it has a secret, a nonce of its own and HMAC(secret, both nonces); the host answers each with
# its own HMAC (or REFUSED), so a member also knows the host holds the secret. Fresh nonces make a
# recorded exchange useless for a later group.
HMAC_MODE, NO_SECRET_MODE, REFUSED = b"hmac-sha256", b"none", b"refused"


def _secret(secret: str | bytes | None) -> bytes | None:
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if isinstance(secret, str):
        secret = secret.encode()
    if secret is not None and (not isinstance(secret, bytes) or not secret):
        raise ValueError(f"secret must be a non-empty str or bytes, got {secret!r}")
    return secret


def _mac(key: bytes, role: bytes, group: str, rank: int, host_nonce: bytes, member_nonce: bytes) -> bytes:
    msg = b"\0".join([role, group.encode(), str(rank).encode(), host_nonce, member_nonce])
    return hmac.new(key, msg, hashlib.sha256).digest()


def _check_secret(auth: Any, group: str, rank: int, world_size: int, key: bytes | None) -> None:
    if rank == 0:
        _host_check(auth, group, world_size, key)
    elif key is None:
        _member_without_secret(auth, rank)
    else:
        _member_check(auth, group, rank, key)


def _host_check(auth: Any, group: str, world_size: int, key: bytes | None) -> None:
    if key is None:
        auth.set("mode", NO_SECRET_MODE)
        return
    nonce = secrets.token_bytes(32)
    auth.set("nonce", nonce)
    auth.set("mode", HMAC_MODE)  # after the nonce: a member that sees the mode finds the nonce
    refused = []
    for r in range(1, world_size):  # each wait is bounded by the store's timeout
        ok, theirs = auth.get(f"{r}/has_secret") == b"1", b""
        if ok:
            proof, theirs = auth.get(f"{r}/proof"), auth.get(f"{r}/nonce")
            ok = hmac.compare_digest(proof, _mac(key, b"member", group, r, nonce, theirs))
        auth.set(f"{r}/verdict", _mac(key, b"host", group, r, nonce, theirs) if ok else REFUSED)
        if not ok:
            refused.append(r)
    if refused:
        # the store lives in this process: keep it up until the refused members have read why
        try:
            auth.wait([f"{r}/seen" for r in refused], timedelta(seconds=HOST_MODE_WAIT_S * 5))
        except RuntimeError:
            pass  # a member that went away reads nothing
        raise PermissionError(
            f"rank(s) {refused} did not prove the shared secret ({SECRET_ENV}); refused them"
        )


def _member_without_secret(auth: Any, rank: int) -> None:
    auth.set(f"{rank}/has_secret", b"0")  # a host that wants a secret refuses this member at once
    try:
        auth.wait(["mode"], timedelta(seconds=HOST_MODE_WAIT_S))
    except RuntimeError:
        return  # a host that is not rollout's: it checks nothing
    if auth.get("mode") == HMAC_MODE:
        auth.set(f"{rank}/seen", b"1")
        raise PermissionError(f"the host requires a shared secret ({SECRET_ENV}) and this side has none")


def _member_check(auth: Any, group: str, rank: int, key: bytes) -> None:
    auth.set(f"{rank}/has_secret", b"1")
    if auth.get("mode") != HMAC_MODE:  # a host that is not rollout's never answers: a timeout
        raise PermissionError("this side has a shared secret, and the host checks none; refused the host")
    nonce, mine = auth.get("nonce"), secrets.token_bytes(32)
    auth.set(f"{rank}/nonce", mine)
    auth.set(f"{rank}/proof", _mac(key, b"member", group, rank, nonce, mine))
    verdict = auth.get(f"{rank}/verdict")
    auth.set(f"{rank}/seen", b"1")
    if verdict == REFUSED:
        raise PermissionError(f"the host refused this side's shared secret ({SECRET_ENV})")
    if not hmac.compare_digest(verdict, _mac(key, b"host", group, rank, nonce, mine)):
        raise PermissionError("the host does not know the shared secret; refused the host")


def _secret_mismatch(auth: Any, rank: int, world_size: int, key: bytes | None) -> str | None:
    """After a timeout: whether a secret on one side only explains it (None when it does not)."""
    try:
        if rank == 0 and key is None:
            want = [r for r in range(1, world_size) if _peek(auth, f"{r}/has_secret") == b"1"]
            return want and f"rank(s) {want} have a shared secret ({SECRET_ENV}) and this side has none"
        if rank != 0 and key is not None and _peek(auth, "mode") is None:
            return "no answer to the shared secret from the host: it has none, or is not rollout's"
    except RuntimeError:  # the host is gone: nothing to tell
        pass
    return None


def _peek(auth: Any, name: str) -> bytes | None:
    return auth.get(name) if auth.check([name]) else None


def leave_group(group: UpdateGroup) -> None:
    dist.destroy_process_group(group.pg)


def _check_args(address: str, port: int, rank: int, world_size: int, name: str, timeout: float) -> None:
    if not isinstance(address, str) or not address:
        raise ValueError(f"master_address must be a host name or IP, got {address!r}")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"master_port must be an int in 1..65535, got {port!r}")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(
            f"world_size must be an int >= 2 (the sender plus the engine ranks), got {world_size!r}"
        )
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is outside the group of {world_size}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"group_name must be a non-empty str, got {name!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text or type(e).__name__ == "DistStoreError"


@contextlib.contextmanager
def _no_split_from_default_group() -> Iterator[None]:
    """When the default group is bound to a device, torch would build an NCCL group by splitting the
    default communicator, a collective over ranks that are not in this group: hide the binding."""
    default = dist.distributed_c10d._world.default_pg if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


# -- moving tensors ------------------------------------------------------------------------------
def broadcast(tensor: torch.Tensor, group: UpdateGroup) -> None:
    """Broadcast from rank 0 of the group (in place on the other ranks)."""
    try:
        dist.broadcast(tensor, group=group.pg, group_src=0)
    except RuntimeError as e:
        if _is_timeout(e):
            raise TimeoutError(f"weights update group {group.name!r}: broadcast timed out ({e})") from e
        raise


def receive_tensors(
    group: UpdateGroup, names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Any]
) -> list[tuple[str, torch.Tensor]]:
    """One broadcast per tensor, in the order of `names`, into fresh buffers."""
    metas = layout(names, dtypes, shapes)
    tensors = [torch.empty(m.shape, dtype=m.dtype, device=group.device) for m in metas]
    for t in tensors:
        broadcast(t, group)
    return [(m.name, t) for m, t in zip(metas, tensors)]


def receive_bucket(
    group: UpdateGroup, names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Any]
) -> FlattenedBucket:
    """One broadcast of the whole flattened buffer (layout rebuilt from names, dtypes, shapes)."""
    metas: list[TensorMeta] = layout(names, dtypes, shapes)
    buffer = empty_buffer(total_bytes(metas), group.device)
    broadcast(buffer, group)
    return FlattenedBucket(buffer, metas)
