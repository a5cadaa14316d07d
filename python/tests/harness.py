"""Holding a bex cluster for Python clients (the tests' fixtures and python/bench): `bex-cluster
run` with `launch.hold`, on loopback, stopped with SIGTERM."""

import os
import pathlib
import signal
import socket
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("BEX_BIN_DIR", REPO / "target" / "release"))


class ClusterError(RuntimeError):
    """The launcher is missing or exited before the cluster was up."""


def free_port_block(n: int) -> int:
    """The first of n consecutive free TCP ports on loopback (checked by binding each)."""
    for base in range(23000, 60000, 97):
        socks = []
        try:
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


def start_cluster(config: pathlib.Path, out: pathlib.Path, *overrides: str):
    """`bex-cluster run` holding the cluster of `config`: (process, OUT/cluster.toml). Its
    clients need the BEX_SECRET it ran with (set it before, or read OUT/secret)."""
    launcher = BIN / "bex-cluster"
    if not launcher.is_file():
        raise ClusterError(
            f"{launcher} missing: cargo build --release -p bex-launcher -p bex-ps-server")
    args = [str(launcher), "run", "--config", str(config), "--out", str(out),
            "--set", "launch.phases=[]", "--set", "launch.hold=true",
            "--set", f"launch.bin_dir={BIN}"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        sys.stderr.write(line)
        if "holding the cluster" in line:
            break
    else:
        proc.wait()
        raise ClusterError(f"bex-cluster exited {proc.returncode} before the cluster was up")
    return proc, out / "cluster.toml"


def stop_cluster(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "the held cluster stopped cleanly"
