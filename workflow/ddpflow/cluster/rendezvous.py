"""Where rank 0's TCPStore listens, and what other ranks are told of it.

torch.distributed's store has no authorisation (PyTorch's SECURITY.md): whoever reaches it can
disturb the job. So it listens on one address, the one the other ranks use, never on a
wildcard. TCPStore binds every interface when it opens its own socket, whatever host it is
given (pytorch #173909); ddpflow binds a socket to the address itself and hands TCPStore the
listening descriptor (`master_listen_fd`, which the libuv store takes).

The address: `machine.network_interface`'s IPv4 address where that key names an interface
(also GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, so gloo and NCCL use it too); otherwise the
address the master's host name resolves to (what the other ranks connect to: the first node of
the allocation, or 127.0.0.1 on one machine). gloo binds the address of the host name too (or
that interface's): nothing of the job listens on 0.0.0.0 or [::].
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct
import time
from pathlib import Path

from ddpflow.errors import UserError
from ddpflow.runtime import atomic_write_bytes

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


class NetworkError(UserError):
    """The interface or address the store should listen on does not exist here."""


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` on this host (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode())
            )
        except OSError as err:
            present = ", ".join(sorted(n for _, n in socket.if_nameindex())) or "none"
            raise NetworkError(
                f"machine.network_interface {name!r}: no IPv4 address on {socket.gethostname()} "
                f"({err.strerror}); its interfaces: {present}. Name one the nodes share (e.g. "
                "the high-speed network's), or null to use the master's host name"
            ) from err
    return socket.inet_ntoa(packed[20:24])


def resolve(host: str) -> str:
    """The address `host` resolves to (IPv4 first), as the other ranks resolve it."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise NetworkError(
            f"the master's host name {host!r} does not resolve on {socket.gethostname()} "
            f"({err.strerror}); set machine.network_interface to the interface the nodes share"
        ) from err
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])  # the host of an IPv4/IPv6 sockaddr (typeshed: str | int)


def use_interface(name: str | None) -> None:
    """gloo and NCCL open their sockets on interface `name` (unless the user set them)."""
    if name:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def listen_address(master_addr: str, interface: str | None) -> str:
    return interface_address(interface) if interface else resolve(master_addr)


def bound_listener(address: str, port: int) -> socket.socket:
    """A listening TCP socket on exactly address:port (port 0: one the OS picks)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener


def master_store(address: str, port: int, world_size: int, timeout: datetime.timedelta, **kw):
    """Rank 0's TCPStore, listening on address:port only. The store owns the descriptor."""
    import torch.distributed as dist

    listener = bound_listener(address, port)
    bound_port = listener.getsockname()[1]
    fd = listener.detach()  # the store's from here on (closed with it)
    return dist.TCPStore(
        address,
        bound_port,
        world_size,
        True,
        timeout=timeout,
        master_listen_fd=fd,
        use_libuv=True,
        **kw,
    )


def publish(port_file: Path, address: str, port: int) -> None:
    """The port file: "<host name> <port> <address>" (readers before the address took the
    second field; they still do)."""
    atomic_write_bytes(port_file, f"{socket.gethostname()} {port} {address}\n".encode())


def read_published(port_file: Path, timeout_s: float) -> tuple[int, str | None]:
    """(port, address or None) once rank 0 has published them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            fields = port_file.read_text().split()
            return int(fields[1]), fields[2] if len(fields) > 2 else None
        time.sleep(0.05)
    raise TimeoutError(f"rank 0 did not publish its port in {port_file} within {timeout_s:.0f}s")
