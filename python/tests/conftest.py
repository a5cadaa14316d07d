"""A real bex cluster for the tests (harness.py): 1 pod x 2 shards on loopback (software
RNIC), started once per session and stopped with SIGTERM at the end."""

import os
import secrets

import pytest

from harness import free_port_block, start_cluster, stop_cluster

# One secret for every cluster of the session and its clients (bex-cluster and bex.Client
# both read BEX_SECRET); the examples' subprocesses inherit it.
os.environ.setdefault("BEX_SECRET", secrets.token_hex(32))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Path of the cluster file clients connect with: 1 pod x 2 shards. Tables: emb (dim 8),
    wide (dim 64), dense (dim 32, Adam) and sgd (dim 4, SGD with lr 0.5, so a test can
    compute the exact result of a push)."""
    out = tmp_path_factory.mktemp("bex")
    cfg = out / "in.toml"
    cfg.write_text(
        "[cluster]\nname = \"pytest\"\npods = 1\nshards = 2\n"
        f"base_port = {free_port_block(6)}\n"
        "[[tables]]\nname = \"emb\"\ndim = 8\n"
        "[[tables]]\nname = \"wide\"\ndim = 64\n"
        "[[tables]]\nname = \"dense\"\ndim = 32\n"
        "optimizer = { kind = \"adam\", lr = 0.003 }\n"
        "[[tables]]\nname = \"sgd\"\ndim = 4\n"
        "init = { kind = \"uniform\", scale = 0.5 }\n"
        "optimizer = { kind = \"sgd\", lr = 0.5 }\n"
        "[server]\ncheckpoint_interval_s = 0\n"
    )
    proc, cluster_toml = start_cluster(cfg, out / "run")
    yield cluster_toml
    stop_cluster(proc)
