"""`localrun rpc-worker`, and the `--rpc` / `--tensor-split` flags of the commands that load
a GGUF model (run, chat, serve, fit).

Registered by localrun.cli through `add_commands`; only argparse-free modules load with
this one, so `localrun --help` stays instant. The C glue lives in localrun/cluster/rpc.py.
"""

from __future__ import annotations

import ctypes
import os
import sys

from localrun.errors import BadRequestError, LocalrunError

START_TIMEOUT = 10.0  # seconds for llama.cpp's server to answer its first HELLO after starting


def add_rpc_flags(p) -> None:
    g = p.add_argument_group("several machines (llama.cpp RPC workers)")
    g.add_argument("--rpc", metavar="HOST:PORT[,HOST:PORT...]", default=None,
                   help="split the model's layers and KV cache over this machine and these `localrun rpc-worker`s")
    g.add_argument("--tensor-split", metavar="N0,N1,...", default=None,
                   help="proportions of the layers for this machine, then each --rpc worker, e.g. 1,2,2"
                   " (default: by free memory)")


def _model_names(args) -> list[str]:
    value = getattr(args, "model", None)
    if not value:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _refuse_mlx(args) -> None:
    """--rpc splits GGUF models only: an MLX model named on the command line is an error now,
    not a load that silently ignores the workers."""
    from localrun.backends import detect_format
    from localrun.store.local import resolve_model

    for name in _model_names(args):
        try:
            fmt = detect_format(resolve_model(name))
        except LocalrunError:
            continue  # a wrong name gets its own error where the model is opened
        if fmt == "mlx":
            raise BadRequestError(f"--rpc splits GGUF models over llama.cpp workers; {name} is an MLX model"
                                  " (MLX runs on one machine here)")


def apply_rpc_flags(args, announce: bool | None = None):
    """Probe and register the --rpc workers: the rpc.Cluster a GGUF load is to split over
    (Engine.open(..., cluster=...)), or None without --rpc."""
    text, split = getattr(args, "rpc", None), getattr(args, "tensor_split", None)
    if not text:
        if split:
            raise BadRequestError("--tensor-split needs --rpc workers to split the model across")
        return None
    from localrun.cluster import rpc

    endpoints = rpc.parse_endpoints(text)
    tensor_split = rpc.parse_tensor_split(split, len(endpoints))
    _refuse_mlx(args)
    cluster = rpc.connect(endpoints, tensor_split)
    if announce if announce is not None else getattr(args, "verbose", False):
        for w in cluster.workers:
            devs = ", ".join(f"{d.name} {_gb(d.free)} free" for d in w.devices)
            print(f"rpc worker {w.endpoint} ({w.hello}): {devs}", file=sys.stderr)
    return cluster


def _gb(n: float) -> str:
    from localrun.hardware import format_bytes

    return format_bytes(n)


# -- fit --rpc -----------------------------------------------------------------------


def fit_workers(args) -> list[tuple[str, int]]:
    """(endpoint, free bytes) of each --rpc worker, asked from its registered devices;
    [] without --rpc."""
    cluster = apply_rpc_flags(args, announce=False)
    if cluster is None:
        return []
    return [(str(w.endpoint), w.free) for w in cluster.workers]


def with_workers(args, budget):
    """(the budget plus the --rpc workers' free memory, [(endpoint, free)]): what `fit` and
    `pull` choose a quant for; the budget unchanged without --rpc."""
    workers = fit_workers(args)
    return (budget.plus_workers([free for _, free in workers]) if workers else budget), workers


def print_fit_split(args, shape, est, workers: list[tuple[str, int]], local_free: int, out=None) -> bool:
    """The per-device lines of `fit --rpc` for the picked estimate; False when a device
    cannot hold its part."""
    from localrun.quant.selector import split_estimate

    out = out or sys.stdout
    from localrun.cluster import rpc

    tensor_split = rpc.parse_tensor_split(getattr(args, "tensor_split", None), len(workers))
    rows = split_estimate(shape, est, local_free, workers, tensor_split)
    how = "by --tensor-split" if tensor_split else "by free memory"
    print(f"split over this machine and {len(workers)} RPC worker(s), {how}:", file=out)
    for row in rows:
        print(f"  {row.explain()}", file=out)
    return all(r.fits for r in rows)


# -- the worker: llama.cpp's server, from the library llama_cpp loaded -----------------


def served_devices() -> list[int]:
    """What a worker offers, as llama.cpp's rpc-server chooses: accelerators, else the CPU."""
    from localrun.cluster import rpc

    g = rpc.ggml()
    devs = [d for d in g.devices() if g.dev_type(d) not in (rpc.DEV_CPU, rpc.DEV_ACCEL) and not g.is_rpc(d)]
    return devs or [d for d in g.devices() if g.dev_type(d) == rpc.DEV_CPU][:1]


# struct ggml_backend_device { struct ggml_backend_device_i iface; reg; context; } (ggml-backend-impl.h):
# iface holds 15 function pointers, get_name first and get_memory third.
_IFACE_SLOTS, _GET_NAME, _GET_MEMORY = 15, 0, 2
_MEMORY_HOOKS: list = []  # keep the callbacks alive


def report_memory(dev: int, offer) -> None:
    """Make the CPU device answer `offer()` -> (free, total) bytes to memory queries.

    The CPU backend says all physical RAM is free; a worker should say what it can spare
    (`--mem`, else the RAM available now). ggml has no setter, so this worker process
    replaces the get_memory pointer of its CPU device's interface, after checking that the
    struct layout is the one expected (its get_name slot must be the device's name function
    and the pointer after the interface its registry)."""
    from localrun.cluster import rpc

    g = rpc.ggml()
    slots = (ctypes.c_void_p * (_IFACE_SLOTS + 2)).from_address(dev)
    name_fn = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(slots[_GET_NAME])
    if slots[_IFACE_SLOTS] != g.dev_reg(dev) or name_fn(dev) != g.dev_name(dev):
        raise LocalrunError("this llama.cpp's device struct is not the layout localrun knows: the worker cannot"
                            " say how much memory it offers (run without --mem)")
    proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))

    def get_memory(_dev, free_p, total_p) -> None:
        free, total = offer()
        free_p[0], total_p[0] = int(free), int(total)

    hook = proto(get_memory)
    _MEMORY_HOOKS.append(hook)
    slots[_GET_MEMORY] = ctypes.cast(hook, ctypes.c_void_p).value


def start_server(endpoint: str, devices: list[int], threads: int, cache_dir: str | None = None) -> None:
    """llama.cpp's server loop (blocks for good; returns only when it cannot listen)."""
    from localrun.cluster import rpc

    fn = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_void_p))(rpc.rpc_function("ggml_backend_rpc_start_server"))
    arr = (ctypes.c_void_p * len(devices))(*devices)
    fn(endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, len(devices), arr)


def _check_bind(host: str, port: int) -> None:
    """The address must be an IPv4 literal of this machine and the port free: llama.cpp's
    server would only say "Failed to create server socket"."""
    import errno
    import ipaddress
    import socket

    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise BadRequestError(f"--host must be an IPv4 address of this machine (llama.cpp's RPC server binds IPv4"
                              f" only), got {host!r}") from None
    if not 0 < port < 65536:
        raise BadRequestError(f"--port must be 1-65535, got {port}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp's server does
        try:
            s.bind((host, port))
        except OSError as exc:
            hint = {errno.EADDRINUSE: "something else (another worker?) listens there: pick another --port",
                    errno.EADDRNOTAVAIL: "that is not an address of this machine"}.get(exc.errno, "")
            raise LocalrunError(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                                + (f" ({hint})" if hint else "")) from None


def _memory_offer(mem_mib: int | None):
    """What the worker's CPU device tells clients: free = RAM available now, or what is left
    of --mem after the buffers this worker already holds."""
    import psutil

    me = psutil.Process()
    baseline = me.memory_info().rss
    total_ram = psutil.virtual_memory().total

    def offer() -> tuple[int, int]:
        available = psutil.virtual_memory().available
        if mem_mib is None:
            return available, total_ram
        cap = mem_mib << 20
        held = max(0, me.memory_info().rss - baseline)
        return max(0, min(cap - held, available)), cap

    return offer


def _wait_until_serving(host: str, port: int, thread) -> str:
    """llama.cpp's server prints nothing once it listens: say HELLO to it (a client that
    hangs up at once) until it answers or its thread has ended."""
    import time

    from localrun.cluster import rpc

    target = rpc.Endpoint("127.0.0.1" if host == "0.0.0.0" else host, port)
    deadline = time.monotonic() + START_TIMEOUT
    while thread.is_alive() and time.monotonic() < deadline:
        try:
            return str(rpc.probe(target, timeout=1.0))
        except rpc.RpcError:
            time.sleep(0.1)
    raise LocalrunError(f"llama.cpp's RPC server did not start on {host}:{port}")


def cmd_rpc_worker(args) -> int:
    import signal
    import threading

    from localrun.cluster import rpc
    from localrun.hardware import inference_threads

    _check_bind(args.host, args.port)
    if not rpc.is_loopback(args.host):
        if not args.allow_network:
            raise BadRequestError(f"--host {args.host} lets other machines drive this one over llama.cpp's RPC,"
                                  " which has no authentication: add --allow-network if this is a LAN or VPN you"
                                  " trust (the default 127.0.0.1 serves this machine only)")
        print(rpc.NETWORK_WARNING, file=sys.stderr)
    threads = args.threads or inference_threads()
    if threads < 1:
        raise BadRequestError(f"--threads must be at least 1, got {threads}")
    if args.mem is not None and args.mem < 1:
        raise BadRequestError(f"--mem must be a positive number of MiB, got {args.mem}")
    usable, why = rpc.availability()
    if not usable:
        raise LocalrunError(f"rpc-worker cannot run: {why}")
    g = rpc.ggml()
    devices = served_devices()
    if g.dev_type(devices[0]) == rpc.DEV_CPU:
        try:
            report_memory(devices[0], _memory_offer(args.mem))
        except LocalrunError:
            if args.mem is not None:
                raise
            print("warning: clients will see all of this machine's RAM as free (llama.cpp's CPU figure)",
                  file=sys.stderr)
    elif args.mem is not None:
        raise BadRequestError("--mem caps what a CPU worker offers; this machine serves its GPUs, which report"
                              " their own free memory")
    cache_dir = None
    if args.cache:
        from localrun.store.local import data_dir

        cache_dir = str(data_dir() / "rpc-cache")
        os.makedirs(cache_dir, exist_ok=True)

    endpoint = f"{args.host}:{args.port}"
    server = threading.Thread(target=start_server, args=(endpoint, devices, threads, cache_dir),
                              name="rpc-server", daemon=True)

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    server.start()
    try:
        version = _wait_until_serving(args.host, args.port, server)
        names = ", ".join(f"{(g.dev_name(d) or b'?').decode()} ({_gb(g.memory(d)[0])} offered)" for d in devices)
        print(f"localrun rpc-worker serving {names} on {endpoint} (RPC {version}, {threads} threads);"
              f" clients use --rpc {endpoint}. Ctrl+C stops it.", file=sys.stderr, flush=True)
        while server.is_alive():
            server.join(0.5)
    except KeyboardInterrupt:
        print("rpc-worker stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)  # llama.cpp's server thread blocks in accept() for good: end the process here
    raise LocalrunError(f"llama.cpp's RPC server on {endpoint} stopped")


def add_commands(sub) -> None:
    from localrun.cluster.rpc import DEFAULT_PORT

    p = sub.add_parser("rpc-worker", help="lend this machine's CPU or GPUs to another machine's --rpc (llama.cpp RPC)")
    p.add_argument("--host", default="127.0.0.1",
                   help="IPv4 address to listen on (default 127.0.0.1: this machine only; others need --allow-network)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the layers served here (default: physical cores)")
    p.add_argument("--mem", type=int, default=None, metavar="MiB",
                   help="memory this worker offers to clients (default: the RAM available now); CPU workers only")
    p.add_argument("--cache", action="store_true",
                   help="keep large tensors received in a local cache, so reloading a model sends less")
    p.add_argument("--allow-network", action="store_true",
                   help="allow a --host other than loopback: llama.cpp's RPC has no authentication or encryption;"
                   " use it only on a LAN or VPN you trust")
    p.set_defaults(func=cmd_rpc_worker)


__all__ = ["add_commands", "add_rpc_flags", "apply_rpc_flags", "fit_workers", "print_fit_split", "with_workers"]
