"""Which models the server has loaded, loading on first request and unloading after an
idle `keep_alive` (Ollama's semantics: a duration, seconds, 0 = unload when done,
negative = keep loaded)."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import Engine
from ..errors import BadRequestError
from .scheduler import QueueFullError, Scheduler

DEFAULT_KEEP_ALIVE = 300.0
REAP_GRACE_S = 2.0
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value) -> float | None:
    """Seconds to stay loaded after the last request; None = forever. Accepts what
    Ollama does: a number of seconds, or a Go duration such as "5m", "1h30m", "-1"."""
    if value is None:
        return DEFAULT_KEEP_ALIVE
    if isinstance(value, bool):
        raise BadRequestError(f"'keep_alive' must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = re.findall(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise BadRequestError(
                    f"'keep_alive' must be a duration such as \"5m\" or a number of seconds, got {value!r}"
                ) from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise BadRequestError(f"'keep_alive' must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    return None if seconds < 0 else seconds


def display_name(path: str) -> str:
    """The name a model is listed under when it was given as a path: the file or folder name."""
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name


@dataclass
class Loaded:
    name: str
    path: str
    engine: Engine
    scheduler: Scheduler
    keep_alive: float | None
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def expires_at(self) -> float | None:
        """Wall-clock time of unloading, None when kept loaded."""
        if self.keep_alive is None:
            return None
        return time.time() + max(0.0, self.keep_alive - (time.monotonic() - self.last_used))


class ModelManager:
    def __init__(
        self,
        models: list[str],
        n_ctx: int | None,
        parallel: int,
        threads: int | None,
        max_queue: int,
        keep_alive: float | None = DEFAULT_KEEP_ALIVE,
        n_batch: int = 256,
        max_loaded: int = 3,
        kv_cache_type: str = "f16",
    ) -> None:
        self.configured = {display_name(m): m for m in models}  # name -> path or store name
        self.default = display_name(models[0]) if models else None
        self.n_ctx, self.parallel, self.threads, self.max_queue = n_ctx, parallel, threads, max_queue
        self.keep_alive = keep_alive
        self.n_batch = n_batch
        self.max_loaded = max_loaded
        self.kv_cache_type = kv_cache_type
        self.loaded: dict[str, Loaded] = {}
        self._loading: dict[str, asyncio.Lock] = {}

    def resolve(self, name: str | None) -> tuple[str, str]:
        """(display name, path) for a request's model field; the default model when empty."""
        if not name:
            if self.default is None:
                raise BadRequestError("no model named: pass 'model' in the request, or start the server with --model")
            name = self.default
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in self.configured:
                return candidate, self.configured[candidate]
            if candidate in self.loaded:
                return candidate, self.loaded[candidate].path
        return name, _resolve_path(name)

    async def get(self, name: str | None, keep_alive=None) -> Loaded:
        display, path = self.resolve(name)
        ttl = self.keep_alive if keep_alive is None else parse_keep_alive(keep_alive)
        model = self.loaded.get(display)
        if model is None:
            # one lock per model: a model that is loading never delays the loaded ones
            lock = self._loading.setdefault(display, asyncio.Lock())
            async with lock:
                model = self.loaded.get(display)
                if model is None:
                    await self._make_room()
                    engine = await asyncio.to_thread(
                        Engine.open, path, n_ctx=self.n_ctx, n_seq=self.parallel, threads=self.threads,
                        n_batch=self.n_batch, kv_cache_type=self.kv_cache_type,
                    )
                    model = Loaded(display, path, engine, Scheduler(engine, self.max_queue, display), ttl)
                    self.loaded[display] = model
        model.keep_alive = ttl
        model.last_used = time.monotonic()
        return model

    async def _make_room(self) -> None:
        """Stay within max_loaded models: unload the least recently used idle one."""
        if len(self.loaded) < self.max_loaded:
            return
        idle = [m for m in self.loaded.values() if not m.scheduler.busy]
        if not idle:
            raise QueueFullError(
                f"{len(self.loaded)} models are loaded and busy (--max-models {self.max_loaded}); retry later"
            )
        await self.unload(min(idle, key=lambda m: m.last_used).name)

    def expire(self, name: str) -> None:
        """keep_alive 0 on a request that names a model but asks nothing: unload it as
        soon as it is idle (not under a client that is still streaming)."""
        model = self.loaded.get(name)
        if model is not None:
            model.keep_alive = 0.0

    def touch(self, model: Loaded) -> None:
        model.last_used = time.monotonic()

    async def unload(self, name: str) -> None:
        model = self.loaded.pop(name, None)
        if model is not None:
            await asyncio.to_thread(_shutdown, model)

    async def reap(self, grace: float = REAP_GRACE_S) -> None:
        """Unload every idle model whose keep_alive has run out. The grace covers the
        moment between a request naming a model and its job reaching the queue (the
        prompt is being tokenized), when the model is in use but not yet busy."""
        now = time.monotonic()
        for model in list(self.loaded.values()):
            if model.keep_alive is None or model.scheduler.busy:
                continue
            if now - model.last_used >= max(model.keep_alive, grace):
                await self.unload(model.name)

    async def close(self) -> None:
        for name in list(self.loaded):
            await self.unload(name)

    def available(self) -> list[tuple[str, str]]:
        """(name, path) of every model a request may name: configured, loaded, and stored."""
        out = dict(self.configured)
        for name, model in self.loaded.items():
            out.setdefault(name, model.path)
        for name, path in _stored_models():
            out.setdefault(name, path)
        return list(out.items())


def _shutdown(model: Loaded) -> None:
    model.scheduler.stop()
    model.engine.close()


def _resolve_path(name: str) -> str:
    """A path, or a name in the model store."""
    from .. import store

    return str(store.resolve_model(name))


def _stored_models() -> list[tuple[str, str]]:
    from .. import store

    try:
        return [(m.name, str(m.path)) for m in store.list_models()]
    except OSError:  # an unreadable store folder still lets the --model models show
        return []
