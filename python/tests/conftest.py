"""A real bex cluster for the tests: `bex-cluster run` with `launch.hold`, 1 pod x 2 shards on
loopback (software RNIC), started once per session and stopped with SIGTERM at the end."""

import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("BEX_BIN_DIR", REPO / "target" / "release"))


def free_port_block(n: int) -> int:
    """The first of n consecutive free TCP ports on loopback (checked by binding each)."""
    for base in range(23000, 60000, 97):
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block on loopback")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Path of the cluster file clients connect with."""
    launcher = BIN / "bex-cluster"
    if not launcher.is_file():
        pytest.fail(f"{launcher} missing: cargo build --release -p bex-launcher -p bex-ps-server")
    out = tmp_path_factory.mktemp("bex")
    cfg = out / "in.toml"
    cfg.write_text(
        "[cluster]\nname = \"pytest\"\npods = 1\nshards = 2\n"
        f"base_port = {free_port_block(6)}\n"
        "[[tables]]\nname = \"emb\"\ndim = 8\n"
        "[[tables]]\nname = \"wide\"\ndim = 64\n"
        "[server]\ncheckpoint_interval_s = 0\n"
    )
    proc = subprocess.Popen(
        [str(launcher), "run", "--config", str(cfg), "--out", str(out / "run"),
         "--set", "launch.phases=[]", "--set", "launch.hold=true",
         "--set", f"launch.bin_dir={BIN}"],
        stdout=subprocess.PIPE, text=True,
    )
    for line in proc.stdout:
        sys.stderr.write(line)
        if "holding the cluster" in line:
            break
    else:
        proc.wait()
        pytest.fail(f"bex-cluster exited {proc.returncode} before the cluster was up")
    # The run's secret (bex-cluster made one up): clients in this process present it.
    os.environ["BEX_SECRET"] = (out / "run" / "secret").read_text()
    yield out / "run" / "cluster.toml"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "the held cluster stopped cleanly"
