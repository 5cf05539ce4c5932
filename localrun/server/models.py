"""Which models the server has loaded, and which it may load.

A model loads on the first request that names it and unloads after an idle `keep_alive`
(Ollama's semantics: a duration, seconds, 0 = unload when done, negative = keep loaded),
or when `--max-models` needs its place.

Leases. Every request holds the models it resolved until its response is over: the
tokenizing and template rendering in worker threads, the embedding, the whole stream.
`ModelManager.get` takes the lease and files it in the request's `RequestLeases` (a
context variable the app's ASGI wrapper sets per request); the wrapper lets go when the
response has been sent or the client hung up. Unloading (keep_alive, the reaper,
eviction) only ever picks a model that no request holds and whose scheduler is idle,
and an engine is freed only once its scheduler thread has exited: a decode may still
run on it otherwise.

What a request may name (`resolve`): the `--model` models (by name or as given), models
already loaded, installed store names, and, only with `--allow-paths`, other .gguf files
and model folders. Anything else gets the same 404 whether or not such a file exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fnmatch
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..model.paths import model_path_kind
from ..store import local as store
from ..backends.base import BackendOptions
from ..backends.compute_threads import on_passing_thread
from ..backends.remote import is_lost
from ..prompt.chat_template import load_template_file
from ..engine import Engine
from ..speculation.draft_model import DRAFT_MAX, DraftPairError
from ..errors import BadRequestError, LocalrunError, ModelLoadError, ModelNotFoundError, UnsupportedFormatError
from .context import ContextChoice, served_context
from .keep_alive import DEFAULT_KEEP_ALIVE, parse_keep_alive
from .scheduler import QueueFullError, Scheduler

log = logging.getLogger("localrun.server")

REAP_GRACE_S = 2.0
RELOAD_WAIT_S = 30.0  # how long a request for a larger context waits for the model's other requests
STORE_TTL_S = 5.0  # how long a listing of the installed models is reused
FOUND_CACHE_MAX = 1024  # store names resolved per listing
NAME_ECHO_CHARS = 120  # how much of a refused model name an error repeats


def display_name(path: str) -> str:
    """The name a model is listed under when it was given as a path: the file or folder name."""
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name


@dataclass(eq=False)
class Loaded:
    name: str
    path: str  # the real path (symlinks and ./.. resolved): one model per file
    engine: Engine
    scheduler: Scheduler
    keep_alive: float | None
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    leases: int = 0  # requests holding it now (event-loop thread only)

    @property
    def expires_at(self) -> float | None:
        """Wall-clock time of unloading, None when kept loaded."""
        if self.keep_alive is None:
            return None
        idle = 0.0 if self.leases else time.monotonic() - self.last_used
        return time.time() + max(0.0, self.keep_alive - idle)


# -- leases ------------------------------------------------------------------------


class RequestLeases:
    """The models one request holds. Tasks and threads a request starts copy its context
    and so share this one object; it is mutated, never replaced."""

    def __init__(self) -> None:
        self._held: list[Loaded] = []

    def hold(self, model: Loaded) -> None:
        model.leases += 1
        self._held.append(model)

    def release(self) -> None:
        """Let every held model go (idempotent); its keep_alive counts from now."""
        now = time.monotonic()
        for model in self._held:
            model.leases -= 1
            model.last_used = now
        self._held.clear()


_request_leases: contextvars.ContextVar[RequestLeases | None] = contextvars.ContextVar(
    "localrun_request_leases", default=None
)


@contextlib.contextmanager
def request_scope():
    """The lease holder of one request: models `get` returns inside are held until the
    block ends (or until the holder's release(), whichever is first)."""
    leases = RequestLeases()
    token = _request_leases.set(leases)
    try:
        yield leases
    finally:
        _request_leases.reset(token)
        leases.release()


# -- what a request may name --------------------------------------------------------


def not_served(name: str) -> ModelNotFoundError:
    """The one answer for every name the server does not serve: it never says whether a
    file of that name exists (Ollama's clients read a 404 as "pull it first")."""
    shown = name if len(name) <= NAME_ECHO_CHARS else name[:NAME_ECHO_CHARS] + "…"
    return ModelNotFoundError(
        f'model "{shown}" not found: name one of the server\'s --model models or an installed model'
        " (see /api/tags; `localrun pull` installs one), or start the server with --allow-paths"
    )


def allowed_path(text: str) -> str:
    """The real path of a model file or folder named by a request under --allow-paths:
    a regular .gguf file that starts with the GGUF magic, or a folder with a regular
    config.json. Only stat() and a non-blocking open are used, so a FIFO, a device or a
    socket is refused without ever waiting on it; an error never quotes the file."""
    if "\0" in text:
        raise ModelNotFoundError(f"no model at {text!r}: a path holds no NUL character")
    path = os.path.realpath(os.path.expanduser(text))
    _, kind = model_path_kind(Path(path))
    if kind == "file":
        if not path.lower().endswith(".gguf") or _head(path, 4) != b"GGUF":
            raise UnsupportedFormatError(f"{text} is not a GGUF file: name a .gguf file or an MLX model folder")
    elif _head(os.path.join(path, "config.json"), 0) is None:
        raise UnsupportedFormatError(
            f"{text} is a folder without config.json: name a .gguf file or an MLX model folder"
        )
    return path


def _head(path: str, n: int) -> bytes | None:
    """The first n bytes of a regular file; None when it is missing or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError):
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(n)


class StoreView:
    """The installed models, listed in a worker thread and reused for `ttl` seconds: a
    listing scans the store, the Hugging Face cache and LM Studio's folder and reads GGUF
    headers, and resolving a bare repo name may ask nvidia-smi what fits; none of that
    may run on the event loop or once per request."""

    def __init__(self, ttl: float = STORE_TTL_S) -> None:
        self.ttl = ttl
        self._models: list[store.StoredModel] = []
        self._listed_at: float | None = None
        self._found: dict[str, str | None] = {}  # store name -> real path, for this listing
        self._lock = asyncio.Lock()

    async def models(self) -> list[store.StoredModel]:
        if self._fresh():
            return self._models
        async with self._lock:  # one scan at a time; who waited reads its result
            if not self._fresh():
                self._models = await asyncio.to_thread(_list_installed)
                self._found = {}
                self._listed_at = time.monotonic()
        return self._models

    async def find(self, name: str) -> str | None:
        """The real path of the installed model a store name stands for, None when none."""
        if not store.is_store_name(name):
            return None
        models = await self.models()
        key = name.lower()
        if key not in self._found:
            if len(self._found) >= FOUND_CACHE_MAX:  # many distinct names within one listing's life
                self._found.clear()
            self._found[key] = await asyncio.to_thread(_resolve_installed, name, models)
        return self._found[key]

    def _fresh(self) -> bool:
        return self._listed_at is not None and time.monotonic() - self._listed_at < self.ttl


def _list_installed() -> list[store.StoredModel]:
    try:
        return store.list_models()
    except OSError as exc:  # an unreadable store folder still lets the --model models serve
        log.warning("could not list the installed models: %s", exc)
        return []


def _resolve_installed(name: str, models: list[store.StoredModel]) -> str | None:
    try:
        return os.path.realpath(store.resolve_installed(name, models))
    except ModelNotFoundError:
        return None


# -- the manager ---------------------------------------------------------------------


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
        allow_paths: bool = False,
        trust_remote_code: bool = False,
        chat_template: str | None = None,
        aliases: list[tuple[str, str]] | None = None,
        cluster=None,
        draft: str | None = None,
        draft_max: int = DRAFT_MAX,
    ) -> None:
        """cluster: the --rpc workers (localrun.cluster.rpc.Cluster) every GGUF is split over.
        draft: a --draft model that drafts for every loaded model it pairs with."""
        self.cluster = cluster
        self.draft, self.draft_max = draft, draft_max
        self.configured = {display_name(m): m for m in models}  # name -> path or store name
        # a --model may be named by its listed name or exactly as it was given
        self._configured_names = {**{m: display_name(m) for m in models}, **{d: d for d in self.configured}}
        self._configured_paths: dict[str, str] = {}  # display name -> real path, for path --models
        self.default = display_name(models[0]) if models else None
        self.n_ctx, self.parallel, self.threads, self.max_queue = n_ctx, parallel, threads, max_queue
        self.keep_alive = keep_alive
        self.n_batch = n_batch
        self.max_loaded = max_loaded
        self.kv_cache_type = kv_cache_type
        self.allow_paths = allow_paths
        self.trust_remote_code = trust_remote_code
        # --chat-template FILE: every model this server loads chats with it; read and checked
        # now, so a broken file stops the server before it serves (the text is /api/show's)
        self.chat_template_file = chat_template
        self.chat_template = load_template_file(chat_template) if chat_template is not None else None
        # --alias NAME=MODEL: NAME (a glob such as claude-*) reaches MODEL, so an agent that
        # sends its own model names finds a local one; first match wins, in the order given
        self.aliases = list(aliases or [])
        # a larger context a request asked for (Ollama's num_ctx), by real path: the model
        # reloads with it and keeps it while it stays loaded
        self._asked_ctx: dict[str, int] = {}
        self.store = StoreView()
        self.loaded: dict[str, Loaded] = {}  # by display name
        self._loading: dict[str, asyncio.Task] = {}  # by real path; each holds a --max-models place
        self._unloading: dict[str, asyncio.Task] = {}  # by real path
        # unloaded models whose scheduler thread had not exited: their engine stays open
        # (and counted) until it has, since freeing it could pull memory from under a decode
        self._stranded: list[Loaded] = []

    # -- names ---------------------------------------------------------------------

    async def resolve(self, name: str | None) -> tuple[str, str]:
        """(display name, real path) of a model a request may name; the default model when
        empty. A model already loaded under another spelling answers with the name it is
        listed under. ModelNotFoundError (404) for anything not served."""
        if not name:
            if self.default is None:
                raise BadRequestError("no model named: pass 'model' in the request, or start the server with --model")
            name = self.default
        display, path = await self._served(name)
        for model in self.loaded.values():
            if model.path == path:
                return model.name, path
        return display, path

    async def _served(self, name: str, aliased: bool = True) -> tuple[str, str]:
        for candidate in dict.fromkeys((name, name.removesuffix(":latest"))):
            if candidate in self.loaded:
                return candidate, self.loaded[candidate].path
            display = self._configured_names.get(candidate)
            if display is not None:
                return display, await self._configured_path(display)
        target = self.alias_target(name) if aliased else None
        if target is not None:
            return await self._served(target, aliased=False)  # an alias names a model, never another alias
        path = await self.store.find(name)
        if path is not None:
            return name, path
        if not self.allow_paths:
            raise not_served(name)
        path = await asyncio.to_thread(allowed_path, name)
        display = display_name(name)
        if display in self.configured:
            try:
                taken = await self._configured_path(display)
            except LocalrunError:  # a --model gone missing still owns its name
                taken = self.configured[display]
        else:
            taken = self.loaded[display].path if display in self.loaded else None
        # the file's name, unless another model goes by it: then its path
        return (display if taken in (None, path) else path), path

    async def _configured_path(self, display: str) -> str:
        """A --model's real path: a path is resolved once, a store name through the listing."""
        if display in self._configured_paths:
            return self._configured_paths[display]
        spec = self.configured[display]
        is_path = await asyncio.to_thread(os.path.lexists, os.path.expanduser(spec))
        if not is_path:
            found = await self.store.find(spec)
            if found is not None:
                return found
        path = await asyncio.to_thread(lambda: os.path.realpath(store.resolve_model(spec)))
        if is_path:
            self._configured_paths[display] = path
        return path

    def alias_target(self, name: str) -> str | None:
        """The model an --alias sends `name` to (exact names before globs), or None."""
        for pattern, target in self.aliases:
            if name == pattern:
                return target
        return next((target for pattern, target in self.aliases if fnmatch.fnmatchcase(name, pattern)), None)

    async def available(self) -> list[tuple[str, str]]:
        """(name, path) of every model a request may name: configured, loaded, installed,
        and the aliases (listed under their NAME, a glob as written)."""
        out = dict(self.configured)
        for name, model in self.loaded.items():
            out.setdefault(name, model.path)
        for m in await self.store.models():
            out.setdefault(m.name, str(m.path))
        for pattern, target in self.aliases:
            display = self._configured_names.get(target)
            out.setdefault(pattern, self.configured[display] if display else out.get(target, target))
        return list(out.items())

    def context_for(self, path: str) -> ContextChoice:
        """The context a load of `path` gets (see context.py): --ctx, a request's larger
        num_ctx, or the trained context where memory allows. Reads the model's header:
        off the event loop."""
        asked = self._asked_ctx.get(path)
        if asked is not None:
            return ContextChoice(asked, f"a request asked for num_ctx {asked}")
        return served_context(path, self.parallel, self.kv_cache_type, fixed=self.n_ctx, draft=self.draft)

    # -- leases and loading ----------------------------------------------------------

    async def get(self, name: str | None, keep_alive=None, n_ctx: int | None = None) -> Loaded:
        """The model, loaded if need be, held by the current request until it ends.
        `n_ctx` (Ollama's num_ctx): a context the model must have at least; a model
        loaded with less reloads with it once no request holds it, as Ollama does."""
        leases = _request_leases.get()
        if leases is None:
            raise RuntimeError("ModelManager.get outside a request: wrap the call in models.request_scope()")
        ttl = self.keep_alive if keep_alive is None else parse_keep_alive(keep_alive)
        display, path = await self.resolve(name)
        if n_ctx is not None:
            await self._want_context(path, n_ctx)
        while True:
            model = self._loaded_at(path)
            if model is not None and is_lost(model.engine.backend):
                self._drop_lost(model)  # its RPC worker died mid-answer: load it again
                continue
            if model is not None and n_ctx is not None and model.engine.n_ctx < n_ctx:
                await self._reload_when_idle(model)
                continue
            if model is not None:  # no await between finding it and holding it
                leases.hold(model)
                model.keep_alive = ttl
                model.last_used = time.monotonic()
                return model
            await self._load(display, path)

    async def _want_context(self, path: str, n_ctx: int) -> None:
        """Check that `n_ctx` fits (a 400 saying the most that does, if not) and remember
        it for the next load of `path` when it is more than the model would get."""
        loaded = self._loaded_at(path)
        if loaded is not None and loaded.engine.n_ctx >= n_ctx:
            return
        if (await asyncio.to_thread(self.context_for, path)).n_ctx >= n_ctx:
            return
        choice = await asyncio.to_thread(served_context, path, self.parallel, self.kv_cache_type, n_ctx,
                                         draft=self.draft)
        self._asked_ctx[path] = max(self._asked_ctx.get(path, 0), choice.n_ctx)

    async def _reload_when_idle(self, model: Loaded) -> None:
        """Unload `model` (to load it again with a larger context) once no request holds
        it; a 503 if others keep it busy past RELOAD_WAIT_S."""
        deadline = time.monotonic() + RELOAD_WAIT_S
        while self.loaded.get(model.name) is model:
            task = self._begin_unload(model)
            if task is not None:
                log.info("%s reloads with a context of %d tokens", model.name, self._asked_ctx[model.path])
                await task
                return
            if time.monotonic() > deadline:
                raise QueueFullError(f"model {model.name} is busy with a smaller context than 'num_ctx' asks;"
                                     " retry when its other requests have ended")
            await asyncio.sleep(0.05)

    def _loaded_at(self, path: str) -> Loaded | None:
        return next((m for m in self.loaded.values() if m.path == path), None)

    async def _load(self, display: str, path: str) -> None:
        """Wait for what is happening to this model (its unload, its load), or start
        loading it; the caller then looks again, since others run meanwhile."""
        busy_with_it = self._unloading.get(path) or self._loading.get(path)
        if busy_with_it is None:
            try:
                victim = self._make_room()
            except QueueFullError:
                if not self._unloading:
                    raise
                await asyncio.wait(set(self._unloading.values()))  # a place is being freed
                return
            busy_with_it = asyncio.create_task(self._open(display, path, victim))
            _track(self._loading, path, busy_with_it)
        await asyncio.shield(busy_with_it)  # a request that gives up leaves the load running

    def _make_room(self) -> Loaded | None:
        """Keep loaded + loading + unloading models within max_loaded: take the least
        recently used idle, unheld model out of `loaded` (the caller unloads it)."""
        occupied = len(self.loaded) + len(self._loading) + len(self._unloading) + len(self._stranded)
        if occupied < self.max_loaded:
            return None
        idle = [m for m in self.loaded.values() if _idle(m)]
        if not idle:
            raise QueueFullError(
                f"{occupied} models are loaded, loading or unloading, and each is in use"
                f" (--max-models {self.max_loaded}); retry later"
            )
        victim = min(idle, key=lambda m: m.last_used)
        del self.loaded[victim.name]
        return victim

    async def _open(self, display: str, path: str, victim: Loaded | None) -> Loaded:
        if victim is not None:
            await self._shutdown(victim)
            if victim in self._stranded:
                raise QueueFullError(f"model {victim.name} is still finishing a step before it unloads; retry later")
        # on a thread that ends with the load: the decodes that time the model at load
        # must leave no OpenMP pool behind (backends.compute_threads)
        model = await asyncio.to_thread(on_passing_thread, self._open_model, display, path, name="localrun-load")
        if display in self.loaded:  # another file took this name meanwhile: list this one by path
            model.name = path
        self.loaded[model.name] = model
        log.info("loaded %s (%s)", model.name, path)
        return model

    def _open_model(self, display: str, path: str) -> Loaded:
        if os.path.isdir(path):
            _check_remote_code(path, self.trust_remote_code)
        # --threads sizes llama.cpp's pool; MLX sizes its own and refuses the option
        threads = None if os.path.isdir(path) else self.threads
        context = self.context_for(path)
        log.info("%s: a context of %d tokens per request (%s)", display, context.n_ctx, context.why)
        cluster = None if os.path.isdir(path) else self.cluster  # MLX runs on one machine here
        options = BackendOptions(n_ctx=context.n_ctx, n_seq=self.parallel, threads=threads, n_batch=self.n_batch,
                                 kv_cache_type=self.kv_cache_type, cluster=cluster,
                                 trust_remote_code=self.trust_remote_code)
        try:
            engine = _open_engine(path, options, self.chat_template_file, self.draft, self.draft_max)
        except (UnsupportedFormatError, ModelLoadError) as exc:
            # the detail may quote the file's first bytes or list a folder: the log keeps it
            log.warning("could not load %s (%s): %s", display, path, exc)
            kind = UnsupportedFormatError if isinstance(exc, UnsupportedFormatError) else ModelLoadError
            raise kind(f'model "{display}" could not be loaded (the server log says why)') from None
        try:
            scheduler = Scheduler(engine, self.max_queue, display)
        except BaseException:
            engine.close()
            raise
        return Loaded(display, path, engine, scheduler, self.keep_alive)

    def _drop_lost(self, model: Loaded) -> None:
        """Take a model whose backend process died out of `loaded`; its scheduler stops and
        its engine is freed in the background (the requests holding it have failed)."""
        del self.loaded[model.name]
        log.warning("%s loads again: %s", model.name, model.engine.backend.lost)
        _track(self._unloading, model.path, asyncio.create_task(self._shutdown(model)))

    # -- unloading -------------------------------------------------------------------

    def expire(self, name: str) -> None:
        """keep_alive 0 on a request that names a model but asks nothing: unload it as
        soon as no request holds it (not under a client that is still streaming)."""
        model = self.loaded.get(name)
        if model is not None:
            model.keep_alive = 0.0

    async def reap(self, grace: float = REAP_GRACE_S) -> None:
        """Unload every unheld, idle model whose keep_alive has run out (and at least
        `grace` seconds ago), and free the engines of stranded models whose thread ended."""
        await self._free_stranded()
        now = time.monotonic()
        due = [m for m in self.loaded.values()
               if m.keep_alive is not None and now - m.last_used >= max(m.keep_alive, grace)]
        tasks = [t for t in (self._begin_unload(m) for m in due) if t is not None]
        if tasks:
            await asyncio.gather(*tasks)

    def _begin_unload(self, model: Loaded) -> asyncio.Task | None:
        """Take an idle, unheld model out of `loaded` and shut it down in a task; None when
        it is held, busy or gone (checked here, with no await before the removal)."""
        if self.loaded.get(model.name) is not model or not _idle(model):
            return None
        del self.loaded[model.name]
        task = asyncio.create_task(self._shutdown(model))
        _track(self._unloading, model.path, task)
        return task

    async def _shutdown(self, model: Loaded) -> None:
        """Stop the model's scheduler; free its engine only if the thread has exited and no
        request holds the model, else keep it (stranded) and try again from reap()."""
        exited = await asyncio.to_thread(model.scheduler.stop)
        if exited and model.leases == 0:
            await asyncio.to_thread(model.engine.close)
            log.info("unloaded %s", model.name)
            return
        self._stranded.append(model)
        log.warning("%s: %s; its memory is kept until then", model.name,
                    "a request still holds it" if exited else "its scheduler thread is still in a step")

    async def _free_stranded(self) -> None:
        for model in [m for m in self._stranded if m.scheduler.exited and m.leases == 0]:
            self._stranded.remove(model)
            await asyncio.to_thread(model.engine.close)
            log.info("unloaded %s (its last step has ended)", model.name)

    async def close(self) -> None:
        """Server shutdown: let loads finish, then stop every model at once (each stop is
        bounded by the scheduler's wait); an engine still in use is left to process exit."""
        if self._loading:
            await asyncio.gather(*self._loading.values(), return_exceptions=True)
        models = list(self.loaded.values())
        self.loaded.clear()
        await asyncio.gather(*(self._shutdown(m) for m in models), *self._unloading.values(),
                             return_exceptions=True)
        await self._free_stranded()


def _track(tasks: dict[str, asyncio.Task], path: str, task: asyncio.Task) -> None:
    """File a task under its model's path until it is done."""
    tasks[path] = task
    task.add_done_callback(lambda t: tasks.pop(path) if tasks.get(path) is t else None)


def _idle(model: Loaded) -> bool:
    return model.leases == 0 and not model.scheduler.busy


def _check_remote_code(path: str, trusted: bool) -> None:
    from ..backends.mlx import check_remote_code

    check_remote_code(path, trusted, "start the server with --trust-remote-code")


def _open_engine(path: str, options: BackendOptions, chat_template: str | None, draft: str | None = None,
                 draft_max: int = DRAFT_MAX) -> Engine:
    """`chat_template`: the --chat-template FILE, None for the model's own template.
    With --rpc workers a GGUF runs in a child process (backends/remote.py): a worker that
    dies then fails the answers in flight, not the server. `draft`: the --draft model,
    which drafts for every model it pairs with (the others load without it: the log
    says why)."""
    if options.cluster is not None:
        from ..backends import open_backend

        template = load_template_file(chat_template) if chat_template is not None else None
        engine = Engine(open_backend(path, options, isolated=True), chat_template=template)
    else:
        engine = Engine.open(path, options, chat_template=chat_template)
    if draft is not None:
        try:
            engine.load_draft(draft, draft_max, options)  # on this machine: load_draft drops the cluster
        except DraftPairError as exc:
            log.warning("%s", exc)
        except BaseException:
            engine.close()
            raise
    return engine
