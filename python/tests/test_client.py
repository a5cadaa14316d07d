"""bex.Client against a real cluster (conftest.py): round trips over RDMA and TCP, errors,
many threads."""

import concurrent.futures
import json
import subprocess

import numpy as np
import pytest

import bex
from harness import BIN


@pytest.fixture(params=["rdma", "tcp"])
def client(cluster, request):
    return bex.Client(cluster, transport=request.param)


def test_tables_are_described(client):
    t = client.tables
    assert set(t) == {"emb", "wide", "dense", "sgd"}
    assert (t["emb"].id, t["emb"].dim) == (0, 8)
    assert t["wide"].dim == 64


def test_fetch_returns_rows_in_key_order_with_duplicates(client):
    keys = np.array([5, 1, 5, 1 << 63], dtype=np.uint64)
    rows = client.fetch("emb", keys)
    assert rows.dtype == np.float32 and rows.shape == (4, 8)
    np.testing.assert_array_equal(rows[0], rows[2])
    # The same rows by table id, bit for bit.
    np.testing.assert_array_equal(client.fetch(0, keys), rows)


def test_a_push_changes_exactly_its_rows_once(client):
    keys = np.arange(1000, 1010, dtype=np.uint64) + (10_000 if client.transport == "tcp" else 0)
    before = client.fetch("wide", keys)
    other = client.fetch("wide", keys + 100_000)
    grads = np.full((len(keys), 64), 0.5, dtype=np.float32)
    client.push("wide", keys, grads)
    after = client.fetch("wide", keys)
    # wide has the default optimizer, SGD with lr 0.01: applied once, exactly.
    np.testing.assert_array_equal(after, before - np.float32(0.01) * grads)
    np.testing.assert_array_equal(client.fetch("wide", keys + 100_000), other)


def test_two_clients_see_the_same_bits(cluster):
    keys = np.arange(0, 300, dtype=np.uint64) * 7919
    a = bex.Client(cluster, transport="rdma").fetch("wide", keys)
    b = bex.Client(cluster, transport="tcp").fetch("wide", keys)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_rows_are_bit_equal_to_what_the_rust_client_sees(client, cluster):
    """bex-rows is the Rust PsClient: same keys, same transport, after a push."""
    keys = np.array([3, 77, 3, 1 << 62], dtype=np.uint64) + np.uint64(
        500_000 if client.transport == "tcp" else 400_000)
    client.push("wide", keys[:2], np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64))
    rows = client.fetch("wide", keys)
    out = subprocess.run(
        [str(BIN / "bex-rows"), "--config", str(cluster), "--table", "wide",
         "--transport", client.transport, "--keys", ",".join(str(k) for k in keys)],
        check=True, capture_output=True, text=True,
    ).stdout.splitlines()
    rust = np.array([json.loads(line)["row"] for line in out], dtype=np.float32)
    assert [json.loads(line)["key"] for line in out] == keys.tolist()
    np.testing.assert_array_equal(rows.view(np.uint32), rust.view(np.uint32))


def test_errors_are_exceptions_named_after_their_cause(cluster, client, tmp_path):
    keys = np.array([1, 2], dtype=np.uint64)
    with pytest.raises(bex.UnknownTable):
        client.fetch("nope", keys)
    with pytest.raises(ValueError):
        client.push("emb", keys, np.zeros((2, 7), dtype=np.float32))
    with pytest.raises(TypeError):
        client.fetch("emb", np.array([1.5], dtype=np.float64))
    with pytest.raises(bex.ConfigError):
        bex.Client(tmp_path / "missing.toml")
    with pytest.raises(bex.ConfigError):
        bex.Client(cluster, transport="carrier-pigeon")
    with pytest.raises(bex.ConfigError):
        bex.Client(cluster, threads=0)
    with pytest.raises(bex.ConfigError, match="pods"):
        bex.Client(cluster, pod=99)  # was RpcError: a mistake in the call, not the cluster
    assert issubclass(bex.UnknownTable, bex.ServerError)
    assert issubclass(bex.ServerError, bex.BexError)


def test_a_stale_cluster_file_gets_the_servers_status(cluster, tmp_path):
    """A client whose file says emb is 16 wide: its first call compares the file's tables
    with the servers' and raises ConfigError naming both widths (the servers would answer a
    16-wide request WrongDim)."""
    text = cluster.read_text()
    stale = tmp_path / "stale.toml"
    stale.write_text(text.replace('dim = 8\nname = "emb"', 'dim = 16\nname = "emb"'))
    assert stale.read_text() != text, "the cluster file's emb entry was rewritten"
    c = bex.Client(stale, transport="tcp")
    with pytest.raises(bex.ConfigError, match="dim 16 here.*dim 8 on the servers"):
        c.fetch("emb", np.array([1, 2], dtype=np.uint64))


def test_a_cluster_file_naming_other_tables_is_refused_before_any_call(cluster, tmp_path):
    """Servers check a request's table id and dim only: a file whose tables stand in another
    order, or under other names, read and pushed the wrong table. The client asks the servers
    for their tables before its first call."""
    text = cluster.read_text()
    renamed = tmp_path / "renamed.toml"
    renamed.write_text(text.replace('name = "emb"', 'name = "clicks"'))
    assert renamed.read_text() != text, "the cluster file's emb entry was renamed"
    c = bex.Client(renamed, transport="tcp")
    keys = np.array([1, 2], dtype=np.uint64)
    with pytest.raises(bex.ConfigError, match="clicks"):
        c.fetch("clicks", keys)
    with pytest.raises(bex.ConfigError, match="clicks"):
        c.push("clicks", keys, np.zeros((2, 8), dtype=np.float32))


def test_an_unreachable_cluster_is_an_rpc_error(tmp_path):
    cfg = tmp_path / "dead.toml"
    cfg.write_text(
        "[cluster]\npods = 1\nshards = 1\nbase_port = 9\n"
        "[[tables]]\nname = \"emb\"\ndim = 8\n"
    )
    c = bex.Client(cfg, transport="tcp", training=False)
    with pytest.raises(bex.RpcError):
        c.fetch("emb", np.array([1], dtype=np.uint64))


def test_many_threads_share_one_client(client):
    def work(i):
        keys = np.arange(i * 64, i * 64 + 64, dtype=np.uint64)
        return i, client.fetch("emb", keys)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = dict(pool.map(work, range(64)))
    for i, rows in results.items():
        np.testing.assert_array_equal(
            rows, client.fetch("emb", np.arange(i * 64, i * 64 + 64, dtype=np.uint64)))


def test_a_forked_child_gets_an_error_not_a_hang(cluster):
    """The client's runtime threads do not survive fork: a call in the child must fail at
    once (a DataLoader worker with the parent's client), and a new client there works."""
    import os

    c = bex.Client(cluster, transport="tcp")
    keys = np.array([1, 2], dtype=np.uint64)
    want = c.fetch("emb", keys)
    pid = os.fork()
    if pid == 0:  # the child: exit status says what happened
        code = 3
        try:
            c.fetch("emb", keys)
            code = 1
        except bex.BexError as e:
            code = 2 if "fork" in str(e) else 4
        if code == 2:
            fresh = bex.Client(cluster, transport="tcp").fetch("emb", keys)
            code = 0 if np.array_equal(fresh, want) else 5
        if code == 0:
            # Replacing the inherited client drops it: that must not wait for the parent's
            # runtime threads, which the child does not have (it hung for ever).
            import gc

            del c
            gc.collect()
        os._exit(code)
    import signal
    import time

    deadline = time.monotonic() + 30
    while (got := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(got[1]) == 0, f"child exit {got[1]}"


def test_a_signal_interrupts_a_waiting_call(tmp_path):
    """A training client retries a push to an unreachable cluster for push_retry_ms (10 s);
    a signal handler's exception (Ctrl-C's KeyboardInterrupt) ends the wait within ~0.1 s."""
    import signal
    import time

    cfg = tmp_path / "dead.toml"
    cfg.write_text(
        "[cluster]\npods = 1\nshards = 1\nbase_port = 9\n"
        "[[tables]]\nname = \"emb\"\ndim = 8\n"
    )
    c = bex.Client(cfg, transport="tcp", training=True)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    started = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            c.push("emb", np.array([1], dtype=np.uint64), np.ones((1, 8), np.float32))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - started < 2.0


def test_sizes_beyond_memory_raise_memory_error_not_abort():
    """A failed allocation in Rust aborts the interpreter: sizes are tried first."""
    with pytest.raises(MemoryError):
        bex.SyntheticClicks(vocab=2**47)  # an 8-byte inverse-CDF entry per id: 1 PiB
    stream = bex.SyntheticClicks(seed=1).train()
    with pytest.raises(MemoryError):
        stream.next_batch(2**60)
    keys, labels = stream.next_batch(3)  # and the stream still works
    assert keys.shape[0] == 3 and labels.shape == (3,)
