"""One model over several machines, on llama.cpp's own RPC layer (ggml-rpc).

A worker (`localrun rpc-worker`) serves its devices over TCP with the library's
`ggml_backend_rpc_start_server`; a client registers each `host:port` as a ggml device
(`ggml_backend_rpc_add_server` + `ggml_backend_register`, as llama.cpp's `--rpc` does) and
passes an explicit NULL-terminated device list in `llama_model_params`, so llama.cpp puts
layers (and their KV cache) on the workers. No transport of our own: everything on the
wire is llama.cpp's. Both ends call the C library that llama_cpp loaded, so a worker and
a client from the same install always speak the same protocol.

What llama.cpp does on trouble, and what this module does about it:
- an endpoint that refuses, times out or is busy with another client (a worker serves one
  client at a time) would block or `GGML_ABORT` inside the client: `probe` checks each one
  first with a plain socket and llama.cpp's HELLO message, so these are one-line errors;
- a worker that dies mid-run, or a protocol version the library refuses, ends in
  `GGML_ABORT` on llama.cpp's own threads, and ggml calls `abort()` right after its abort
  callback returns. `install_abort_hook` makes that callback print one `error:` line and
  end the process with exit code 3 instead of a core dump; nothing in-process can survive
  it (the decode waits on a promise the dead connection never fulfils).

Placement: the local machine counts as one device (its GPUs where it has any, else its
CPU), followed by each worker's devices. Without `--tensor-split` the shares follow free
memory. On a CPU-only client the local share is the first layers, kept off the offload
list through `n_gpu_layers`, the same knob as llama.cpp's `-ngl`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
from bisect import bisect_right
from dataclasses import dataclass, replace

from localrun.errors import BadRequestError, LocalrunError
from localrun.ggml import function

DEFAULT_PORT = 50052  # llama.cpp's rpc-server default
PROBE_TIMEOUT = 3.0  # seconds for a connect and for the HELLO answer: a LAN answers in milliseconds
MAX_WORKERS = 16  # GGML_RPC_MAX_SERVERS in ggml-rpc.h
HELLO_COMMAND = 14  # RPC_CMD_HELLO; ggml-rpc.cpp asserts it never changes
HELLO_CAPS = 24  # RPC_CONN_CAPS_SIZE of protocol 7: all zero asks for no transport upgrade
MAX_HELLO_REPLY = 64  # larger than any HELLO answer: a bigger size field is another service
# ggml_backend_dev_type
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL = 0, 1, 2, 3

NETWORK_WARNING = (
    "WARNING: the RPC server has no authentication and no encryption, and remote-code-execution"
    " bugs have been found in it (llama.cpp: never expose it to an open network). Bind it only"
    " to an address of a LAN or VPN you trust."
)


class RpcError(LocalrunError):
    """A worker cannot be used: unreachable, busy, or not a llama.cpp RPC server."""

    exit_code = 3
    http_status = 503


# -- endpoints -----------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> list[Endpoint]:
    """`HOST:PORT[,HOST:PORT...]` as llama.cpp reads it: IPv4 addresses or host names
    (llama.cpp's client connects over IPv4 only), each endpoint once."""
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    if not items:
        raise BadRequestError("--rpc needs HOST:PORT[,HOST:PORT...], e.g. --rpc 192.168.1.20:50052")
    endpoints: list[Endpoint] = []
    for item in items:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadRequestError(f"--rpc takes HOST:PORT items (port 1-65535), got {item!r}")
        if ":" in host or host.startswith("["):
            raise BadRequestError(f"--rpc {item}: llama.cpp's RPC client speaks IPv4 only; give an IPv4 address or a name")
        ep = Endpoint(host, int(port))
        if ep in endpoints:
            raise BadRequestError(f"--rpc names {ep} twice")
        endpoints.append(ep)
    if len(endpoints) > MAX_WORKERS:
        raise BadRequestError(f"--rpc takes at most {MAX_WORKERS} workers (llama.cpp's limit), got {len(endpoints)}")
    return endpoints


def parse_tensor_split(text: str | None, n_workers: int) -> tuple[float, ...] | None:
    """`--tensor-split N0,N1,...`: proportions for this machine, then each --rpc worker."""
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.replace("/", ",").split(","))
    except ValueError:
        raise BadRequestError(f"--tensor-split takes numbers like 1,3,3, got {text!r}") from None
    if len(values) != n_workers + 1:
        raise BadRequestError(f"--tensor-split needs {n_workers + 1} proportions (this machine, then each of the"
                              f" {n_workers} --rpc workers), got {len(values)}")
    if any(not v >= 0 or v == float("inf") for v in values) or not sum(values) > 0:
        raise BadRequestError(f"--tensor-split proportions must be finite, >= 0 and not all 0, got {text!r}")
    return values


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Hello:
    """What a worker answered to HELLO; `version` None when its answer has another layout
    (another protocol generation: llama.cpp's own handshake then decides)."""

    version: tuple[int, int, int] | None

    def __str__(self) -> str:
        return "v" + ".".join(map(str, self.version)) if self.version else "another protocol layout"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def probe(endpoint: Endpoint, timeout: float = PROBE_TIMEOUT) -> Hello:
    """Connect and say HELLO as llama.cpp's client does, then hang up (the worker goes back
    to waiting for the next client). Raises RpcError with what went wrong."""
    where = f"the RPC worker at {endpoint}"
    try:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
    except socket.gaierror:
        raise RpcError(f"{where}: cannot resolve the host name {endpoint.host!r}") from None
    except ConnectionRefusedError:
        raise RpcError(f"{where} refused the connection: is `localrun rpc-worker --port {endpoint.port}`"
                       " running there (and bound to an address this machine can reach)?") from None
    except (socket.timeout, TimeoutError):
        raise RpcError(f"{where} did not accept a connection within {timeout:g} s"
                       " (wrong address, or a firewall drops it)") from None
    except OSError as exc:
        raise RpcError(f"{where} cannot be reached: {exc.strerror or exc}") from None
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", HELLO_COMMAND, HELLO_CAPS) + bytes(HELLO_CAPS))
            head = _recv_exact(sock, 8)
        except (socket.timeout, TimeoutError):
            raise RpcError(f"{where} accepted but did not answer within {timeout:g} s: it is busy with another"
                           " client (a worker serves one client at a time)") from None
        except OSError:
            return Hello(None)  # reset on our HELLO: another protocol generation, llama.cpp judges
        if len(head) < 8:
            return Hello(None)  # closed on our HELLO: a worker of another protocol does that
        (size,) = struct.unpack("<Q", head)
        if not 3 <= size <= MAX_HELLO_REPLY:
            raise RpcError(f"{where} answered, but not as a llama.cpp RPC worker (is another service on that port?)")
        try:
            body = _recv_exact(sock, size)
        except OSError:
            body = b""
        if size != 4 + HELLO_CAPS or len(body) != size:
            return Hello(None)
        return Hello((body[0], body[1], body[2]))


# -- the C library -------------------------------------------------------------------


class _Ggml:
    """The ggml functions this module calls (localrun.ggml finds them)."""

    def __init__(self) -> None:
        P, S, C = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        self.reg_by_name = function("ggml_backend_reg_by_name", P, C)
        self.reg_proc = function("ggml_backend_reg_get_proc_address", P, P, C)
        self.register = function("ggml_backend_register", None, P)
        self.reg_name = function("ggml_backend_reg_name", C, P)
        self.reg_dev_count = function("ggml_backend_reg_dev_count", S, P)
        self.reg_dev_get = function("ggml_backend_reg_dev_get", P, P, S)
        self.dev_count = function("ggml_backend_dev_count", S)
        self.dev_get = function("ggml_backend_dev_get", P, S)
        self.dev_name = function("ggml_backend_dev_name", C, P)
        self.dev_description = function("ggml_backend_dev_description", C, P)
        self.dev_memory = function("ggml_backend_dev_memory", None, P, ctypes.POINTER(S), ctypes.POINTER(S))
        self.dev_type = function("ggml_backend_dev_type", ctypes.c_int, P)
        self.dev_reg = function("ggml_backend_dev_backend_reg", P, P)
        self.dev_by_type = function("ggml_backend_dev_by_type", P, ctypes.c_int)
        self.dev_buffer_type = function("ggml_backend_dev_buffer_type", P, P)
        self.abort_callback_type = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
        self.set_abort_callback = function("ggml_set_abort_callback", P, self.abort_callback_type)

    def memory(self, dev: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)

    def devices(self) -> list[int]:
        return [self.dev_get(i) for i in range(self.dev_count())]

    def rpc_registry(self) -> int | None:
        return self.reg_by_name(b"RPC") or None

    def is_rpc(self, dev: int) -> bool:
        return (self.reg_name(self.dev_reg(dev)) or b"").startswith(b"RPC")


_GGML: _Ggml | None = None


def ggml() -> _Ggml:
    global _GGML
    if _GGML is None:
        _GGML = _Ggml()
    return _GGML


def availability() -> tuple[bool, str]:
    """(usable, why) for `localrun doctor` and the tests' skip reason."""
    try:
        g = ggml()
    except Exception as exc:  # llama_cpp missing or its libraries unusable
        return False, f"unusable: {exc}"
    if not g.rpc_registry():
        return False, ("llama-cpp-python was built without GGML_RPC; scripts/setup.sh builds it with RPC"
                       " (CMAKE_ARGS='-DGGML_RPC=ON -DGGML_RPC_RDMA=OFF')")
    return True, "available: `localrun rpc-worker` serves this machine; --rpc HOST:PORT uses workers"


def rpc_function(name: str) -> int:
    g = ggml()
    reg = g.rpc_registry()
    if not reg:
        raise LocalrunError(availability()[1])
    addr = g.reg_proc(reg, name.encode())
    if not addr:
        raise LocalrunError(f"this llama.cpp's RPC backend has no {name}; reinstall llama-cpp-python with RPC")
    return addr


# -- the client: workers as devices --------------------------------------------------


@dataclass(frozen=True)
class Device:
    """An offload device: a worker's (endpoint set) or a local GPU's."""

    handle: int  # ggml_backend_dev_t
    name: str  # "RPC0", "CUDA0"
    endpoint: str | None
    free: int
    total: int


@dataclass(frozen=True)
class Worker:
    endpoint: Endpoint
    hello: Hello
    devices: tuple[Device, ...]

    @property
    def free(self) -> int:
        return sum(d.free for d in self.devices)


@dataclass(frozen=True)
class Cluster:
    """RPC workers to split a model over, as `connect` found them: a value the caller
    hands to the model it loads (Engine.open(..., cluster=...)). Their registration with
    llama.cpp is process-wide and happens once per endpoint (see `any_registered`)."""

    workers: tuple[Worker, ...]
    tensor_split: tuple[float, ...] | None = None  # this machine, then each worker


_REGISTERED: dict[str, int] = {}  # endpoint -> ggml_backend_reg_t, once per process


def any_registered() -> bool:
    """Whether this process registered workers with llama.cpp (whose default device list
    then names them: a model loaded without a cluster must name this machine's own)."""
    return bool(_REGISTERED)


def connect(endpoints: list[Endpoint], tensor_split: tuple[float, ...] | None = None) -> Cluster:
    """Probe every endpoint, then register each with llama.cpp and read its devices."""
    usable, why = availability()
    if not usable:
        raise RpcError(f"--rpc cannot be used: {why}")
    hellos = {str(ep): probe(ep) for ep in endpoints}  # every endpoint checked before llama.cpp sees one
    versions = {h.version for h in hellos.values() if h.version}
    if len(versions) > 1:
        listing = ", ".join(f"{ep} {h}" for ep, h in hellos.items())
        raise RpcError(f"the RPC workers speak different protocol versions ({listing}):"
                       " install the same llama-cpp-python on every machine")
    install_abort_hook(hellos)
    g = ggml()
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(rpc_function("ggml_backend_rpc_add_server"))
    workers = []
    for ep in endpoints:
        key = str(ep)
        if key not in _REGISTERED:
            reg = add_server(key.encode())  # connects and asks the device count (a refusal aborts: hooked)
            if not reg:
                raise RpcError(f"the RPC worker at {key} offers no devices")
            g.register(reg)
            _REGISTERED[key] = reg
        reg = _REGISTERED[key]
        devs = []
        for i in range(g.reg_dev_count(reg)):
            dev = g.reg_dev_get(reg, i)
            free, total = g.memory(dev)
            devs.append(Device(dev, (g.dev_name(dev) or b"?").decode(), key, free, total))
        workers.append(Worker(ep, hellos[key], tuple(devs)))
    return Cluster(tuple(workers), tensor_split)


def local_gpus() -> list[Device]:
    """This machine's own GPUs (what llama.cpp offloads to by default), in registry order."""
    g = ggml()
    out = []
    for dev in g.devices():
        if g.dev_type(dev) in (DEV_GPU, DEV_IGPU) and not g.is_rpc(dev):
            free, total = g.memory(dev)
            out.append(Device(dev, (g.dev_name(dev) or b"?").decode(), None, free, total))
    return out


def local_free_ram() -> int:
    from localrun.hardware import probe as probe_hardware

    return probe_hardware(refresh=True).ram_available


# -- placement -----------------------------------------------------------------------


def layer_owners(n_layer: int, n_gpu_layers: int, split: tuple[float, ...]) -> list[int]:
    """The device index (-1: this machine's CPU) of every repeating layer and, last, of the
    output layer, exactly as llama_model_base::load_tensors assigns them."""
    import numpy as np

    f32 = np.float32  # llama.cpp computes the split points in float: so does this, to agree at the edges
    n_dev = len(split)
    scan, acc = [], f32(0)
    for s in split:
        acc = f32(acc + f32(s))
        scan.append(acc)
    scan = [f32(v / acc) if acc else f32(0) for v in scan]
    start = max(n_layer + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer + 1) if n_dev else 0
    owners = []
    for il in range(n_layer + 1):
        if il < start or il - start >= act:
            owners.append(-1)
        else:
            owners.append(min(bisect_right(scan, f32(f32(il - start) / f32(act))), n_dev - 1))
    return owners


@dataclass(frozen=True)
class Placement:
    """What one llama.cpp load gets: the offload devices, their proportions and how many
    layers are offloaded; `local` names what this machine contributes."""

    devices: tuple[Device, ...]
    split: tuple[float, ...]
    n_gpu_layers: int
    n_layer: int
    local: str

    def owners(self) -> list[int]:
        return layer_owners(self.n_layer, self.n_gpu_layers, self.split)

    def layer_counts(self) -> list[tuple[str, int]]:
        """(holder, repeating layers) for this machine and every device, in order."""
        owners = self.owners()[: self.n_layer]
        rows = [(self.local, sum(1 for o in owners if o == -1))]
        for i, dev in enumerate(self.devices):
            rows.append((dev.endpoint or dev.name, sum(1 for o in owners if o == i)))
        return rows

    def describe(self) -> str:
        return ", ".join(f"{who}: {n} layers" for who, n in self.layer_counts()) + "; output head: this machine"


def split_layers(n_layer: int, gpu_frees: list[int], worker_frees: list[list[int]], local_free: int,
                 tensor_split: tuple[float, ...] | None = None) -> tuple[list[float], int]:
    """The arithmetic of a placement, on plain numbers: each device's proportion (this
    machine's GPUs, then each worker's devices, in that order) and how many layers are
    offloaded (llama.cpp's n_gpu_layers). Shares go by free memory (or --tensor-split:
    this machine first); a holder's share is spread over its devices by their free
    memory. `fit --rpc` prices a split with it before any model is loaded."""
    shares = list(tensor_split) if tensor_split else [float(sum(gpu_frees) or local_free)] + [
        float(sum(frees)) for frees in worker_frees]
    split: list[float] = []

    def spread(frees, share):
        room = sum(frees)
        split.extend(share * (free / room if room else 1.0 / len(frees)) for free in frees)

    if gpu_frees:
        spread(gpu_frees, shares[0])
    for frees, share in zip(worker_frees, shares[1:]):
        spread(frees, share)
    if gpu_frees:  # the local GPUs take this machine's share; its CPU keeps the input layer only
        return split, n_layer + 1
    total = sum(shares)
    return split, round((n_layer + 1) * (total - shares[0]) / total) if total else n_layer + 1


def plan(n_layer: int, workers: tuple[Worker, ...], gpus: list[Device], local_free: int,
         tensor_split: tuple[float, ...] | None = None) -> Placement:
    """The device list, per-device proportions and n_gpu_layers llama.cpp takes (see
    split_layers)."""
    split, offloaded = split_layers(n_layer, [g.free for g in gpus], [[d.free for d in w.devices] for w in workers],
                                    local_free, tensor_split)
    devices = tuple(gpus) + tuple(d for w in workers for d in w.devices)
    local = "this machine (GPU)" if gpus else "this machine"
    return Placement(devices, tuple(split), offloaded, n_layer, local)


def refreshed(worker: Worker) -> Worker:
    """The worker with its devices' free memory asked again (another load may have taken some)."""
    g = ggml()
    return replace(worker, devices=tuple(replace(d, **dict(zip(("free", "total"), g.memory(d.handle))))
                                         for d in worker.devices))


def placement_for(cluster: Cluster, n_layer: int) -> Placement:
    workers = tuple(refreshed(w) for w in cluster.workers)
    return plan(n_layer, workers, local_gpus(), local_free_ram(), cluster.tensor_split)


class _BuftOverride(ctypes.Structure):  # llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# The output norm and head, and the token embeddings a tied head is a copy of (the input
# copy stays on this machine anyway).
HEAD_TENSORS = rb"^(output|output_norm|token_embd)\."


def head_override(placement: Placement) -> ctypes.Array:
    """tensor_buft_overrides for llama_model_params that keep the output head on this
    machine (its first GPU, else its CPU). llama.cpp would put it on the last device, and
    the logits (n_vocab floats: 196 KB a token for SmolLM2, 1 MB for Gemma-3) would then
    cross the network every token instead of one hidden state (n_embd floats)."""
    g = ggml()
    local = next((d.handle for d in placement.devices if d.endpoint is None), None) or g.dev_by_type(DEV_CPU)
    return (_BuftOverride * 2)(_BuftOverride(HEAD_TENSORS, g.dev_buffer_type(local)), _BuftOverride(None, None))


def device_array(devices) -> ctypes.Array:
    """A NULL-terminated ggml_backend_dev_t array for llama_model_params.devices."""
    handles = [d.handle if isinstance(d, Device) else d for d in devices]
    return (ctypes.c_void_p * (len(handles) + 1))(*handles, None)


# -- GGML_ABORT ----------------------------------------------------------------------

_ABORT_HOOK = None  # the ctypes callback, alive for the process
# Leave a full-screen app's terminal usable: main screen, cursor shown, mouse reports off.
_TERMINAL_RESET = b"\x1b[?1049l\x1b[?25h\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l"


def _terminal_restorer():
    """A function that puts the terminal back as it is now (the chat app changes its modes
    and an exit from inside llama.cpp skips the app's own cleanup)."""
    try:
        import termios

        fd = 0
        saved = termios.tcgetattr(fd) if os.isatty(fd) else None
    except (ImportError, OSError):
        return lambda: None

    def restore() -> None:
        try:
            if saved is not None:
                termios.tcsetattr(fd, termios.TCSANOW, saved)
            if os.isatty(1):
                os.write(1, _TERMINAL_RESET)
        except OSError:  # no terminal left to restore: the error line is what matters
            return

    return restore


def accepts(endpoint: str, timeout: float = 0.5) -> bool:
    """Whether something still accepts connections at host:port (a dead worker's port refuses,
    a vanished machine's times out). Also backends/remote.py's test for a lost worker."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def abort_message(message: str, hellos: dict[str, Hello]) -> str | None:
    """The one line to print for a GGML_ABORT raised by the RPC client; None for others."""
    if "ggml-rpc" not in message:
        return None
    text = message.split(": ", 1)[-1].strip()
    for ep, hello in hellos.items():
        if ep in text and "handshake" in text:
            return (f"the RPC worker at {ep} speaks another RPC protocol ({hello}) than this llama-cpp-python:"
                    " install the same version on every machine")
        if ep in text:
            return f"lost the RPC worker at {ep} ({text}); check that it still runs and is reachable"
    if "Remote RPC server crashed" in text:
        gone = [ep for ep in hellos if not accepts(ep)]
        who = f"the RPC worker at {', '.join(gone)}" if gone else "an RPC worker"
        return (f"{who} stopped answering (it was stopped, crashed or the network dropped); this process"
                " cannot go on without its layers: restart the worker and run again")
    return f"llama.cpp's RPC client stopped: {text}"


def install_abort_hook(hellos: dict[str, Hello]) -> None:
    """Turn GGML_ABORTs of the RPC client into `error: ...` and exit code 3 (no core dump);
    other aborts keep llama.cpp's behaviour (its message, then abort())."""
    global _ABORT_HOOK
    g = ggml()
    restore_terminal = _terminal_restorer()

    def hook(raw: bytes) -> None:
        message = (raw or b"").decode("utf-8", "replace")
        line = abort_message(message, hellos)
        if line is None:
            os.write(2, (message + "\n").encode())
            return  # ggml calls abort() next, as without the hook
        restore_terminal()
        os.write(2, f"error: {line}\n".encode())
        os._exit(RpcError.exit_code)

    _ABORT_HOOK = g.abort_callback_type(hook)
    g.set_abort_callback(_ABORT_HOOK)


__all__ = ["Cluster", "DEFAULT_PORT", "Device", "Endpoint", "Hello", "NETWORK_WARNING", "Placement", "RpcError",
           "Worker", "availability", "connect", "layer_owners", "parse_endpoints", "parse_tensor_split",
           "placement_for", "plan", "probe", "rpc_function", "split_layers"]
