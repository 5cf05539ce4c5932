"""Experimental: one MLX model over several processes or machines, on MLX's ring backend
(`mx.distributed`, plain TCP, in the CPU build on Linux too) and mlx-lm's tensor-parallel
`model.shard()`.

Every rank loads the model and keeps 1/N of each attention and MLP projection (so the
head counts and the MLP width must divide by N). Rank 0 runs localrun's engine over a
RingBackend: each call that runs the model or edits its KV cache is first sent to the
other ranks over the same ring (an all_sum to which only rank 0 adds the call), then run
on rank 0's slice; the other ranks (`localrun mlx-worker`) run the same call on theirs,
so the collectives inside every layer line up. Sampling, grammars and templates stay on
rank 0, as on one machine.

Limits: each rank reads the whole model before keeping its slice (localrun's MLX loader
is not lazy); no embeddings (a pass on rank 0 alone would stall the ring); a rank that
dies stalls or ends the others (MLX's ring has no recovery). The ring has no
authentication either: LAN or VPN only.

Hostfile: MLX's own JSON, one list of "ip:port" per rank, e.g.
`[["192.168.1.10:5000"], ["192.168.1.11:5000"]]` (what `mlx.launch` writes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from localrun.errors import BadRequestError, LocalrunError, UnsupportedFormatError

DECODE, TRIM, COPY, CLEAR, STOP = 1, 2, 3, 4, 5


def _mx():
    import mlx.core as mx

    return mx


def join_ring(hostfile: str, rank: int):
    """The ring group of this process; MLX reads the hostfile and rank from its environment."""
    mx = _mx()
    if not mx.distributed.is_available("ring"):
        raise LocalrunError("this MLX build has no ring backend (mx.distributed)")
    os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = str(hostfile), str(rank)
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() < 2:
        raise BadRequestError(f"the hostfile {hostfile} names fewer than 2 ranks")
    return group


def check_shardable(model, config: dict, n: int) -> None:
    """mlx-lm's tensor-parallel shard() must exist for the architecture, and it cuts the
    heads and the MLP width into n equal parts."""
    cfg = {**config, **(config.get("text_config") or {})}
    arch = cfg.get("model_type", "this architecture")
    if not hasattr(model, "shard"):
        raise UnsupportedFormatError(f"mlx-lm cannot shard {arch} models across ranks (no tensor-parallel"
                                     " shard() for it); run it on one machine")
    sizes = {"attention heads": cfg.get("num_attention_heads"), "KV heads": cfg.get("num_key_value_heads"),
             "MLP width": cfg.get("intermediate_size")}
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % n}
    if bad:
        listing = ", ".join(f"{v} {k}" for k, v in bad.items())
        raise BadRequestError(f"tensor parallelism over {n} ranks needs counts divisible by {n}; this model has"
                              f" {listing}")


def _broadcast(group, values: list[int] | None) -> list[int]:
    """Rank 0's values on every rank: a length, then the values, each an all_sum to which
    the other ranks add zeros."""
    mx = _mx()
    leader = group.rank() == 0
    n = mx.distributed.all_sum(mx.array([len(values) if leader else 0], dtype=mx.int32), group=group, stream=mx.cpu)
    n = int(n.item())
    payload = mx.array(values if leader else [0] * n, dtype=mx.int32)
    return [int(v) for v in mx.distributed.all_sum(payload, group=group, stream=mx.cpu).tolist()]


def _open_sharded(path: str, group, **options):
    from localrun.backends.mlx import MLXBackend

    backend = MLXBackend(path, **options)
    model = backend.model
    check_shardable(model, backend.config, group.size())
    model.shard(group)
    _mx().eval(model.parameters())  # keep this rank's slices, free the rest
    return backend


class RingBackend:
    """Rank 0's backend: every model call goes to the other ranks first."""

    def __init__(self, inner, group) -> None:
        self._inner, self._group = inner, group

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def decode(self, batch):
        call = [DECODE, len(batch)]
        for e in batch:
            call += [e.seq, e.pos, e.n_logits, len(e.tokens), *e.tokens]
        _broadcast(self._group, call)
        return self._inner.decode(batch)

    def kv_trim(self, seq: int, n_keep: int) -> None:
        _broadcast(self._group, [TRIM, seq, n_keep])
        self._inner.kv_trim(seq, n_keep)

    def kv_copy(self, src: int, dst: int, n: int) -> None:
        _broadcast(self._group, [COPY, src, dst, n])
        self._inner.kv_copy(src, dst, n)

    def kv_clear(self, seq: int) -> None:
        _broadcast(self._group, [CLEAR, seq])
        self._inner.kv_clear(seq)

    def embed(self, tokens):
        raise BadRequestError("embeddings are not available on an MLX ring (a pass on one rank would stall the others)")

    def close(self) -> None:
        if self._inner is not None:
            _broadcast(self._group, [STOP])
            self._inner.close()
            self._inner = None


def follow(backend, group) -> None:
    """A follower rank: run every call rank 0 sends until it says STOP."""
    from localrun.backends.base import BatchEntry

    while True:
        call = _broadcast(group, None)
        op, args = call[0], call[1:]
        if op == STOP:
            return
        if op == DECODE:
            batch, i = [], 1
            for _ in range(args[0]):
                seq, pos, n_logits, n = args[i : i + 4]
                batch.append(BatchEntry(seq, args[i + 4 : i + 4 + n], pos, n_logits))
                i += 4 + n
            backend.decode(batch)
        elif op == TRIM:
            backend.kv_trim(*args)
        elif op == COPY:
            backend.kv_copy(*args)
        elif op == CLEAR:
            backend.kv_clear(*args)
        else:
            raise LocalrunError(f"mlx-worker: rank 0 sent an unknown call {op}")


def loopback_hostfile(n: int) -> str:
    """A hostfile for n ranks on this machine, on ports the OS says are free now."""
    import socket

    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    fd, path = tempfile.mkstemp(prefix="localrun-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    return path


def _options(args) -> dict:
    return dict(n_ctx=args.ctx, n_seq=1, kv_cache_type=args.kv_cache_type)


def cmd_mlx_worker(args) -> int:
    group = join_ring(args.hostfile, args.rank)
    if group.rank() == 0:
        raise BadRequestError("rank 0 runs the engine: start it with `localrun mlx-ring --hostfile`")
    backend = _open_sharded(args.model, group, **_options(args))
    print(f"mlx-worker rank {group.rank()} of {group.size()} ready", file=sys.stderr, flush=True)
    follow(backend, group)
    return 0


def cmd_mlx_ring(args) -> int:
    """Rank 0: open the sharded model, run one prompt through localrun's engine."""
    from localrun.engine import Engine
    from localrun.request import GenerationRequest
    from localrun.sampling import SamplingParams

    if (args.ranks is None) == (args.hostfile is None):
        raise BadRequestError("give --ranks N (this machine, for a try) or --hostfile FILE (rank 0 of a ring)")
    if args.ranks is not None and args.ranks < 2:
        raise BadRequestError(f"--ranks must be at least 2, got {args.ranks}")
    hostfile = args.hostfile or loopback_hostfile(args.ranks)
    followers = []
    if args.ranks:
        base = [sys.executable, "-m", "localrun.cli", "mlx-worker", args.model, "--hostfile", hostfile]
        extra = ["--kv-cache-type", args.kv_cache_type] + (["--ctx", str(args.ctx)] if args.ctx else [])
        followers = [subprocess.Popen([*base, "--rank", str(r), *extra]) for r in range(1, args.ranks)]
    try:
        group = join_ring(hostfile, 0)
        engine = Engine(RingBackend(_open_sharded(args.model, group, **_options(args)), group))
        with engine:
            tokens = engine.chat_prompt([{"role": "user", "content": args.prompt}])
            request = GenerationRequest(sampling=SamplingParams(temperature=args.temperature),
                                        max_tokens=args.max_tokens, lookup=False)
            for ev in engine.generate(tokens, request):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
    finally:
        deadline = time.monotonic() + 30
        for p in followers:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        if args.ranks:
            Path(hostfile).unlink(missing_ok=True)
    return 0


def add_commands(sub) -> None:
    def model_flags(p):
        p.add_argument("model", help="an MLX model folder (every rank needs the same files)")
        p.add_argument("--ctx", type=int, default=None, help="context size in tokens (default: min(4096, trained))")
        p.add_argument("--kv-cache-type", choices=("f16", "q8_0", "q4_0"), default="f16", help="KV cache element type")

    p = sub.add_parser("mlx-ring", help="(experimental) answer one prompt with an MLX model sharded over ring ranks")
    model_flags(p)
    p.add_argument("prompt", help="the prompt")
    p.add_argument("--ranks", type=int, default=None, help="start this many ranks on this machine (loopback)")
    p.add_argument("--hostfile", default=None, help="MLX ring hostfile; this process is rank 0")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.set_defaults(func=cmd_mlx_ring)
    p = sub.add_parser("mlx-worker", help="(experimental) a follower rank of `localrun mlx-ring --hostfile`")
    model_flags(p)
    p.add_argument("--hostfile", required=True, help="MLX ring hostfile (the same on every rank)")
    p.add_argument("--rank", type=int, required=True, help="this process's rank (1..N-1; rank 0 is mlx-ring)")
    p.set_defaults(func=cmd_mlx_worker)


__all__ = ["RingBackend", "add_commands", "check_shardable", "follow", "join_ring", "loopback_hostfile"]
