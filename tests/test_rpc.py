"""One model over several machines on llama.cpp's RPC layer: endpoint parsing, the probe
(against fake servers), the layer placement, and real `localrun rpc-worker` processes on
loopback ports serving SmolLM2 and Gemma-3 to `run`, `chat` and `fit`. `serve --rpc` and
the model hosted in a child process are in test_rpc_serve.py."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rpc_workers import (
    GREEDY, PROMPT, FakeServer, WorkerProcess, error_lines, free_port, has_rpc, localrun, needs_rpc, worker_pair)

from localrun.cluster import rpc
from localrun.errors import BadRequestError


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    yield from worker_pair(tmp_path_factory)


# -- endpoints and proportions ---------------------------------------------------------


def test_endpoints_parse_as_llama_cpp_reads_them():
    eps = rpc.parse_endpoints(" 192.168.1.20:50052, box.lan:6000 ")
    assert [str(e) for e in eps] == ["192.168.1.20:50052", "box.lan:6000"]


@pytest.mark.parametrize("text, words", [
    ("", "HOST:PORT"),
    ("10.0.0.1", "HOST:PORT"),
    ("10.0.0.1:0", "1-65535"),
    ("10.0.0.1:x", "HOST:PORT"),
    ("[::1]:50052", "IPv4 only"),
    ("fe80::1:50052", "IPv4 only"),
    ("a:1,a:1", "twice"),
    (",".join(f"h{i}:1" for i in range(17)), "at most 16"),
])
def test_bad_endpoints_are_one_line_errors(text, words):
    with pytest.raises(BadRequestError, match=re.escape(words)):
        rpc.parse_endpoints(text)


def test_tensor_split_names_this_machine_then_each_worker():
    assert rpc.parse_tensor_split("1,2,2", 2) == (1.0, 2.0, 2.0)
    assert rpc.parse_tensor_split(None, 2) is None
    for text, words in (("1,2", "needs 3 proportions"), ("1,-1,1", ">= 0"), ("0,0,0", "not all 0"),
                        ("1,x,1", "numbers"), ("1,nan,1", ">= 0")):
        with pytest.raises(BadRequestError, match=re.escape(words)):
            rpc.parse_tensor_split(text, 2)


# -- placement -------------------------------------------------------------------------


def test_layer_owners_follow_llama_cpps_split_points():
    """llama_model_base::load_tensors: layers below n_layer + 1 - n_gpu_layers stay on the
    CPU; the rest go to the device whose cumulative share first exceeds their position."""
    # 4 layers + head, all offloaded, 1:1 -> positions 0, .2, .4 | .6, .8
    assert rpc.layer_owners(4, 5, (1.0, 1.0)) == [0, 0, 0, 1, 1]
    # 3 offloaded: layers 0-1 on the CPU, then 1:2 over positions 0, 1/3, 2/3
    assert rpc.layer_owners(4, 3, (1.0, 2.0)) == [-1, -1, 0, 1, 1]
    assert rpc.layer_owners(4, 5, (0.0, 1.0)) == [1, 1, 1, 1, 1]  # a zero share gets nothing
    assert rpc.layer_owners(4, 0, (1.0,)) == [-1] * 5


def _worker(name: str, *frees: int) -> rpc.Worker:
    host, port = name.split(":")
    devs = tuple(rpc.Device(i + 1, f"RPC{i}", name, f, f) for i, f in enumerate(frees))
    return rpc.Worker(rpc.Endpoint(host, int(port)), rpc.Hello((7, 0, 0)), devs)


def test_plan_keeps_this_machines_share_on_its_cpu():
    w = (_worker("a:1", 100), _worker("b:2", 200))
    p = rpc.plan(30, w, [], 100)  # by free memory: 1:1:2 of 31 slots
    assert p.n_gpu_layers == 23 and p.split == (100.0, 200.0)
    assert p.layer_counts() == [("this machine", 8), ("a:1", 8), ("b:2", 14)]
    assert rpc.plan(30, w, [], 100, (1.0, 0.0, 1.0)).layer_counts() == [("this machine", 15), ("a:1", 0), ("b:2", 15)]


def test_the_placement_arithmetic_runs_on_plain_numbers_as_plan_does():
    """`fit --rpc` prices a split before any worker is connected: split_layers takes free
    bytes, not devices, and gives what plan() gives the devices."""
    assert rpc.split_layers(30, [], [[100], [200]], 100) == ([100.0, 200.0], 23)
    assert rpc.split_layers(30, [300], [[100, 200]], 0) == ([300.0, 100.0, 200.0], 31)
    split, offloaded = rpc.split_layers(30, [], [[100], [200]], 100, (1.0, 0.0, 1.0))
    assert rpc.layer_owners(30, offloaded, split)[:30].count(-1) == 15  # this machine keeps half


def test_plan_gives_this_machines_share_to_its_gpus_and_spreads_a_worker_over_its_devices():
    gpu = rpc.Device(9, "CUDA0", None, 300, 400)
    p = rpc.plan(30, (_worker("a:1", 100, 200),), [gpu], 0)
    assert p.n_gpu_layers == 31  # everything offloaded: the GPU holds this machine's share
    assert [d.name for d in p.devices] == ["CUDA0", "RPC0", "RPC1"]
    assert p.split == (300.0, 100.0, 200.0)
    assert p.describe().startswith("this machine (GPU): 0 layers, CUDA0: ")


def test_device_array_is_null_terminated():
    arr = rpc.device_array([rpc.Device(0x1000, "RPC0", "a:1", 0, 0), 0x2000])
    assert [arr[i] for i in range(3)] == [0x1000, 0x2000, None]


# -- the probe, against fake servers ---------------------------------------------------


def test_probe_says_hello_as_llama_cpp_and_reads_the_version():
    server = FakeServer(lambda c: c.sendall(struct.pack("<Q", 28) + bytes([7, 1, 2, 0]) + bytes(24)))
    try:
        assert rpc.probe(server.endpoint).version == (7, 1, 2)
        assert server.received == bytes([14]) + struct.pack("<Q", 24) + bytes(24)  # RPC_CMD_HELLO, 24 caps
    finally:
        server.close()


def test_probe_errors_name_the_worker_and_the_cause():
    port = free_port()  # nothing listens there
    with pytest.raises(rpc.RpcError, match=f"127.0.0.1:{port} refused the connection"):
        rpc.probe(rpc.Endpoint("127.0.0.1", port))
    silent = FakeServer(lambda c: time.sleep(2))  # accepts, never answers: busy with another client
    try:
        with pytest.raises(rpc.RpcError, match="busy with another client"):
            rpc.probe(silent.endpoint, timeout=0.5)
    finally:
        silent.close()
    http = FakeServer(lambda c: c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n"))
    try:
        with pytest.raises(rpc.RpcError, match="not as a llama.cpp RPC worker"):
            rpc.probe(http.endpoint)
    finally:
        http.close()


def test_probe_leaves_another_protocol_generation_to_llama_cpp():
    """A worker of another protocol hangs up on a HELLO of the wrong size: the version is
    unknown, and llama.cpp's own handshake (under the abort hook) gives the verdict."""
    server = FakeServer(lambda c: None)
    try:
        assert rpc.probe(server.endpoint).version is None
    finally:
        server.close()


def test_rpc_aborts_become_one_line_that_names_the_worker():
    gone = f"127.0.0.1:{free_port()}"  # nothing listens: the worker that is gone
    alive = FakeServer(lambda c: None)
    hellos = {gone: rpc.Hello((8, 0, 0)), str(alive.endpoint): rpc.Hello((7, 0, 0))}
    try:
        assert "speaks another RPC protocol (v8.0.0)" in rpc.abort_message(
            f"/src/ggml-rpc.cpp:550: RPC handshake failed for {gone}", hellos)
        line = rpc.abort_message("/src/ggml-rpc.cpp:35: Remote RPC server crashed or returned malformed response",
                                 hellos)
        assert f"the RPC worker at {gone} stopped answering" in line and str(alive.endpoint) not in line
    finally:
        alive.close()
    assert rpc.abort_message("/src/llama-kv-cache.cpp:9: GGML_ASSERT(x) failed", hellos) is None  # not ours


# -- command-line errors (any build) ---------------------------------------------------


def test_unreachable_worker_is_a_one_line_error(smollm2_gguf):
    res = localrun("run", str(smollm2_gguf), PROMPT, "--rpc", f"127.0.0.1:{free_port()}", timeout=120)
    assert res.returncode == 3, res.stderr
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    if has_rpc():
        assert "refused the connection" in lines[0]
    else:
        assert "built without GGML_RPC" in lines[0]
    assert res.stdout == ""


def test_worker_binds_other_addresses_only_when_allowed():
    res = localrun("rpc-worker", "--host", "0.0.0.0", "--port", str(free_port()), timeout=60)
    assert res.returncode == 1 and "--allow-network" in res.stderr and "no authentication" in res.stderr
    res = localrun("rpc-worker", "--host", "localhost", timeout=60)
    assert res.returncode == 1 and "IPv4 address" in res.stderr


def test_tensor_split_without_workers_is_refused(smollm2_gguf):
    res = localrun("run", str(smollm2_gguf), PROMPT, "--tensor-split", "1,1", timeout=60)
    assert res.returncode == 1 and "--tensor-split needs --rpc" in res.stderr


# -- real workers ----------------------------------------------------------------------


def buffers_by_device(log: str) -> dict[str, float]:
    """`load_tensors: RPC0[127.0.0.1:P] model buffer size = 12.34 MiB` lines of llama.cpp's log."""
    out: dict[str, float] = {}
    for dev, mib in re.findall(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB", log):
        out[dev] = out.get(dev, 0.0) + float(mib)
    return out


@needs_rpc
@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf"])
def test_two_workers_give_the_local_greedy_answer(model, workers, request):
    path = str(request.getfixturevalue(model))
    local = localrun("run", path, PROMPT, *GREEDY)
    assert local.returncode == 0, local.stderr
    endpoints = ",".join(w.endpoint for w in workers)
    split = localrun("run", path, PROMPT, *GREEDY, "--rpc", endpoints, "--tensor-split", "1,1,1", "--verbose",
                     env={"LOCALRUN_LLAMA_LOG": "1"})
    assert split.returncode == 0, split.stderr[-3000:]
    assert split.stdout == local.stdout and split.stdout.strip()
    buffers = buffers_by_device(split.stderr)
    for w in workers:  # both workers hold a part of the weights
        assert any(dev.startswith("RPC") and w.endpoint in dev and mib > 1 for dev, mib in buffers.items()), buffers
    # every layer sits where localrun's placement said it would (RPC0 is the first --rpc worker)
    from localrun.quant.selector import model_shape

    n_layer = model_shape(Path(path)).n_layer
    plan = rpc.plan(n_layer, (_worker("a:1", 1), _worker("b:2", 1)), [], 1, (1.0, 1.0, 1.0))
    expected = {il: "CPU" if o < 0 else f"RPC{o}" for il, o in enumerate(plan.owners())}
    logged = {int(il): dev for il, dev in re.findall(r"layer +(\d+) assigned to device (\w+)", split.stderr)}
    assert logged == expected and len(set(logged.values())) == 3
    assert all(f"rpc worker {w.endpoint} (v" in split.stderr for w in workers)  # --verbose names each worker


@needs_rpc
def test_fit_shows_the_split_over_the_workers(workers, smollm2_gguf):
    res = localrun("fit", str(smollm2_gguf), "--rpc", ",".join(w.endpoint for w in workers),
                   "--tensor-split", "1,1,1", "--ctx", "512")
    assert res.returncode == 0, res.stderr
    lines = {line.strip().split(": ")[0]: line for line in res.stdout.splitlines() if line.startswith("  ")
             and " layers, " in line}
    assert set(lines) == {"this machine"} | {w.endpoint for w in workers}, res.stdout
    counts = [int(re.search(r"(\d+) layers", line).group(1)) for line in lines.values()]
    assert sorted(counts) == [9, 10, 11]  # SmolLM2's 30 layers (+ the head), a third each, as the load puts them
    assert "does not fit" not in res.stdout


@needs_rpc
def test_a_killed_worker_ends_the_answer_with_one_error_line(tmp_path, smollm2_gguf):
    """The piped chat answers once over two workers; one is then killed, and the next
    answer ends with `error:` and exit code 3 instead of a core dump."""
    doomed, other = WorkerProcess(tmp_path), WorkerProcess(tmp_path)
    try:
        chat = subprocess.Popen([sys.executable, "-m", "localrun.cli", "chat", str(smollm2_gguf), *GREEDY,
                                 "--rpc", f"{doomed.endpoint},{other.endpoint}", "--tensor-split", "1,1,1"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        chat.stdin.write(PROMPT + "\n")
        chat.stdin.flush()
        first = chat.stdout.readline()  # the first answer streams back, then a blank line
        assert first.strip(), chat.stderr.read() if chat.poll() is not None else "no answer"
        doomed.proc.kill()
        doomed.proc.wait()
        out, err = chat.communicate("And three more?\n", timeout=120)
        assert chat.returncode == 3, err
        last = error_lines(err)[-1]
        assert last.startswith("error: ") and f"the RPC worker at {doomed.endpoint} stopped answering" in last, err
        assert "Aborted" not in err and "backtrace" not in err.lower()
    finally:
        doomed.stop()
        other.stop()


# -- MLX ring (experimental) -------------------------------------------------------------


def test_mlx_shard_check_names_what_does_not_divide():
    from localrun.errors import UnsupportedFormatError
    from localrun.commands.mlx_ring import check_shardable

    class Sharded:
        def shard(self, group):
            raise AssertionError("only checked")

    smollm2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    check_shardable(Sharded(), smollm2, 3)  # 9 / 3 / 1536 all divide by 3
    with pytest.raises(BadRequestError, match="divisible by 2; this model has 9 attention heads, 3 KV heads"):
        check_shardable(Sharded(), smollm2, 2)
    with pytest.raises(UnsupportedFormatError, match="mlx-lm cannot shard gpt_bigcode"):
        check_shardable(object(), {"model_type": "gpt_bigcode"}, 2)


@pytest.mark.slow
def test_mlx_ring_of_three_ranks_matches_one_process(smollm2_mlx):
    """SmolLM2 (9 heads, 3 KV heads) over 3 ring ranks on loopback: rank 0 runs localrun's
    engine, and the greedy answer is the single-process one."""
    import mlx.core as mx

    if not mx.distributed.is_available("ring"):
        pytest.skip("this MLX build has no ring backend")
    question = "What is the capital of France?"
    one = localrun("run", str(smollm2_mlx), question, "--temperature", "0", "--max-tokens", "8", "--no-lookup",
                   "--ctx", "256", timeout=600)
    assert one.returncode == 0, one.stderr
    ring = localrun("mlx-ring", str(smollm2_mlx), question, "--ranks", "3", "--max-tokens", "8", "--ctx", "256",
                    timeout=900)
    assert ring.returncode == 0, ring.stderr[-2000:]
    assert ring.stdout == one.stdout and one.stdout.strip()
    assert "rank 1 of 3 ready" in ring.stderr and "rank 2 of 3 ready" in ring.stderr


@needs_rpc
def test_worker_offers_what_mem_says(tmp_path):
    """--mem is what a client reads from the registered device (and what the split follows)."""
    worker = WorkerProcess(tmp_path, "--mem", "512")
    try:
        assert "CPU (512 MB offered)" in worker.stderr()
        code = ("from localrun.cluster import rpc; import sys; "
                "c = rpc.connect(rpc.parse_endpoints(sys.argv[1])); "
                "print(c.workers[0].free, c.workers[0].devices[0].total)")
        res = subprocess.run([sys.executable, "-c", code, worker.endpoint], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        free, total = map(int, res.stdout.split())
        assert total == 512 << 20 and 0 < free <= total
    finally:
        assert worker.stop() == 0
