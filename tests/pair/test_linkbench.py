"""`sparkple pair-check` between two real processes over gloo on this machine's loopback: the
rendezvous, the timed all-reduces, the table, the JSON, the floor's refusal and the bad input.

torch (CPU) is in the tools venv; without it the rank processes fail, and the test with them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_local import ansible_playbook
from pair_inventory import pair_hostvars

from sparkple.cli import main as cli_main
from sparkple.pair.linkbench import MIB, Figure, bus_factor

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(rank: int, port: int, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "sparkple.cli", "pair-check", f"--rank={rank}"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={port}", "--timeout-s=60"]
    cmd += ["--pair=duo", "--head=duo-head", "--worker=duo-worker", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_pair(args0: list[str], args1: list[str]) -> list[tuple[int, str, str]]:
    """Both ranks started before either is waited for (they rendezvous)."""
    port = free_port()
    procs = [start(0, port, *args0), start(1, port, *args1)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    return results


QUICK = ["--max-mib=4", "--warmup=1", "--iters=3"]


def test_two_ranks_measure_every_size_and_print_the_table_and_json(tmp_path: Path) -> None:
    json_out = tmp_path / "pair-check.json"
    # rank 0 prints JSON (and writes it), rank 1 prints the table: both outputs in one run
    (rc0, out0, err0), (rc1, out1, err1) = run_pair(
        [*QUICK, "--transport=socket", "--json", f"--json-out={json_out}"],
        [*QUICK, "--transport=socket"],
    )
    assert rc0 == 0, err0
    assert rc1 == 0, err1
    result = json.loads(out0)
    assert json.loads(json_out.read_text()) == result
    assert result["backend"] == "gloo" and result["device"] == "cpu"
    assert (result["pair"], result["head"], result["worker"]) == ("duo", "duo-head", "duo-worker")
    assert result["transport"] == "socket" and result["floor_gbps"] == 0
    assert result["ok"] is True
    figures = result["figures"]
    assert [f["size_bytes"] for f in figures] == [1 * MIB, 2 * MIB, 4 * MIB]
    for f in figures:
        assert f["time_us"] > 0
        # nccl-tests: algbw = S / t, busbw = algbw * 2(n-1)/n (n = 2: the same figure)
        assert f["algbw_gbps"] == pytest.approx(f["size_bytes"] / (f["time_us"] / 1e6) / 1e9)
        assert f["busbw_gbps"] == pytest.approx(f["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert result["peak_busbw_gbps"] == max(f["busbw_gbps"] for f in figures)
    # the table: a header and one row per size, with its size and figures as printed
    table = result["table"]
    assert len(table) == 1 + len(figures) and "busbw (GB/s)" in table[0]
    for row, f in zip(table[1:], figures, strict=True):
        words = row.split()
        assert int(words[0]) == f["size_bytes"]
        assert float(words[-1]) == pytest.approx(f["busbw_gbps"], abs=1e-3)
    # rank 1 printed the same table (both ranks take the slower rank's time) and the verdict
    lines = out1.splitlines()
    assert lines[: len(table)] == table
    assert "peak bus bandwidth" in lines[-1] and "(transport socket has no floor)" in lines[-1]


def test_a_peak_below_the_floor_is_refused_naming_the_pair_the_figure_and_the_floor(
    tmp_path: Path,
) -> None:
    json_out = tmp_path / "refused.json"
    floor = "--floor-gbps=100000"  # far above any loopback: the refusal, whatever this machine
    (rc0, out0, err0), (rc1, _, err1) = run_pair(
        [*QUICK, floor, "--json", f"--json-out={json_out}"], [*QUICK, floor]
    )
    assert (rc0, rc1) == (1, 1), (err0, err1)
    result = json.loads(out0)
    assert result["ok"] is False and result["floor_gbps"] == 100000
    assert json.loads(json_out.read_text())["ok"] is False  # the figures are kept all the same
    for err in (err0, err1):
        message = err.strip().splitlines()[-1]
        assert message.startswith("sparkple pair-check: pair duo: duo-head (rank 0) and duo-worker")
        assert f"peak bus bandwidth {result['peak_busbw_gbps']:.2f} GB/s" in message
        assert "below the floor of 100000 GB/s for transport ib" in message
        assert "NCCL_IB_HCA" in message and "sparkple_pair_transport: socket" in message


def test_a_rank_whose_peer_never_comes_says_so() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "sparkple.cli", "pair-check", "--rank=1", "--pair=duo"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", "--timeout-s=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 1
    message = done.stderr.strip().splitlines()[-1]
    assert "pair duo" in message and "rank 1 did not meet the head (rank 0) within 2 s" in message
    assert "start both ranks together" in message


def test_nccl_without_a_cuda_device_is_refused() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "sparkple.cli", "pair-check", "--rank=0", "--backend=nccl"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 1
    assert "--backend nccl needs a CUDA device" in done.stderr


@pytest.fixture(autouse=True)
def no_rendezvous_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def cli(*args: str) -> tuple[int, str]:
    """`sparkple pair-check ARGS` in this process: the input is checked before torch loads."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli_main(["pair-check", *args])
    return rc, err.getvalue()


GOOD = ["--rank=0", "--master-addr=10.0.0.1", "--master-port=29511"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rank=2", *GOOD[1:]], "--rank 2: use 0 on the head and 1 on the worker"),
        ([*GOOD[:2], "--master-port=70000"], "--master-port 70000 is not a TCP port"),
        ([*GOOD, "--max-mib=3"], "--max-mib 3: use a power of two"),
        ([*GOOD, "--min-mib=0"], "--min-mib 0: use a power of two"),
        ([*GOOD, "--min-mib=8", "--max-mib=4"], "--min-mib 8 is above --max-mib 4"),
        ([*GOOD, "--max-mib=2048"], "--max-mib 2048: at most 1024"),
        ([*GOOD, "--iters=0"], "1 or more timed ones"),
        ([*GOOD, "--backend=mpi"], "--backend mpi: use one of auto, nccl, gloo"),
        ([*GOOD, "--transport=tcp"], "--transport tcp: use one of ib, socket"),
        ([*GOOD, "--floor-gbps=-1"], "--floor-gbps -1.0: use 0 (no floor) or more"),
        (["--rank=0", "--master-port=29511"], "pair-check needs --rank"),
    ],
)
def test_bad_input_is_refused_naming_the_flag(args: list[str], says: str) -> None:
    rc, err = cli(*args)
    assert rc == 1
    assert says in err, err


def test_the_environment_stands_in_for_the_flags_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("RANK", "one")
    rc, err = cli()
    assert rc == 1 and "RANK='one' in the environment: use a whole number" in err
    monkeypatch.setenv("RANK", "1")
    rc, err = cli("--max-mib=5")
    assert rc == 1 and "--max-mib 5: use a power of two" in err  # got past the rendezvous flags


def test_bus_bandwidth_is_nccl_tests_all_reduce_correction() -> None:
    assert bus_factor(2) == 1.0
    assert bus_factor(8) == pytest.approx(1.75)
    f = Figure.of(256 * MIB, 0.02, ranks=4)
    assert f.algbw_gbps == pytest.approx(256 * MIB / 0.02 / 1e9)
    assert f.busbw_gbps == pytest.approx(f.algbw_gbps * 1.5)
    assert f.time_us == pytest.approx(20_000)


# --- the playbook: both ranks at once on two hosts of a real ansible-playbook run -------------


def pair_inventory(tmp_path: Path) -> dict[str, Path]:
    """A pair of two local hosts (127.0.0.1 and 127.0.0.2 on lo), each with its own release
    directory holding release r1 as `current`; returns each host's release directory."""
    releases = {}
    for host in ("duo-head", "duo-worker"):
        release = tmp_path / host / "releases"
        (release / "r1").mkdir(parents=True)
        (release / "r1" / "release.json").write_text(
            json.dumps({"id": "r1", "inputs": {"image": "lab-host-python3:/none"}})
        )
        (release / "current").symlink_to("r1")
        releases[host] = release
    hosts = pair_hostvars(
        hosts=("duo-head", "duo-worker"),
        pair="duo",
        addresses=("127.0.0.1", "127.0.0.2"),
        interface="lo",
        hcas=("rocep1s0f1", "roceP2p1s0f1"),
        both={
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ansible_become": False,
            "sparkple_pair_master_port": free_port() - 10,  # the check's port: master port + 10
        },
        head={"sparkple_release_dir": str(releases["duo-head"])},
        worker={"sparkple_release_dir": str(releases["duo-worker"])},
    )
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"all": {"children": {"sparks": {"hosts": hosts}}}}))
    return releases


def play(
    tmp_path: Path, *args: str, path: str = "", **knobs: object
) -> subprocess.CompletedProcess[str]:
    """playbooks/pair_check.yml on pair_inventory's hosts, the ranks run by this Python (the
    lab's way: no image), with small sizes; one fork: each rank is started before either is
    waited for, so they meet all the same."""
    variables = {
        # the lab fleet's launcher (docs/tensor-parallel.md), with this Python as the host's
        "sparkple_host_python": f"/usr/bin/env PYTHONPATH={ROOT} {sys.executable}",
        "sparkple_pair_check_launcher": "{{ sparkple_host_python | split }}",
        "sparkple_pair_check_max_mib": 2,
        "sparkple_pair_check_warmup": 1,
        "sparkple_pair_check_iters": 2,
        "sparkple_pair_check_timeout_s": 60,
        **knobs,
    }
    variables = {k: v for k, v in variables.items() if v is not None}  # None: left to default
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(ROOT / "roles"), "ANSIBLE_FORKS": "1"}
    env["PATH"] = f"{path}:{env['PATH']}" if path else env["PATH"]
    env.pop("ANSIBLE_CONFIG", None)
    cmd = [ansible_playbook(), "-i", str(tmp_path / "inventory.json"), *args]
    cmd += [str(ROOT / "playbooks" / "pair_check.yml"), "-e", json.dumps(variables)]
    return subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def kept(releases: dict[str, Path]) -> dict[str, dict]:
    """The figures each host kept with its release."""
    return {
        host: json.loads(path.read_text())
        for host, release in releases.items()
        if (path := release / "r1" / "pair-check.json").exists()
    }


def test_the_playbook_runs_both_ranks_prints_the_table_and_keeps_the_figures(
    tmp_path: Path,
) -> None:
    # one fork: the ranks still meet, as each is started before either is waited for
    releases = pair_inventory(tmp_path)
    done = play(tmp_path, sparkple_pair_transport="socket")
    assert done.returncode == 0, done.stdout + done.stderr
    figures = kept(releases)
    assert set(figures) == {"duo-head", "duo-worker"}
    head, worker = figures["duo-head"], figures["duo-worker"]
    assert (head["rank"], worker["rank"]) == (0, 1)
    assert head["figures"] == worker["figures"] and head["transport"] == "socket"
    assert head["master"].startswith("127.0.0.1:")
    assert "pair duo: all-reduce between duo-head and duo-worker (gloo, transport socket)" in (
        done.stdout
    )
    for row in head["table"]:
        assert row in done.stdout  # the head's table, printed as measured


FAKE_DOCKER = """#!/bin/sh
# docker as the check's default launcher calls it: `rm` answers there is nothing to remove;
# `run` records its argv, then runs what follows the image with the test's Python
echo "$@" >> "$FAKE_DOCKER_LOG"
[ "$1" = rm ] && exit 1
while [ "$1" != "lab-image@sha256:0123" ]; do shift; done
shift
exec env PYTHONPATH="$FAKE_DOCKER_ROOT" "$FAKE_DOCKER_PYTHON" "$@"
"""


def test_the_default_launcher_runs_the_release_image_with_the_pair_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases = pair_inventory(tmp_path)
    for release in releases.values():
        meta = release / "r1" / "release.json"
        meta.write_text(json.dumps({"id": "r1", "inputs": {"image": "lab-image@sha256:0123"}}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    log = tmp_path / "docker.log"
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(log))
    monkeypatch.setenv("FAKE_DOCKER_ROOT", str(ROOT))
    monkeypatch.setenv("FAKE_DOCKER_PYTHON", sys.executable)
    done = play(
        tmp_path,
        path=str(bin_dir),
        sparkple_pair_check_launcher=None,
        sparkple_pair_check_docker_options=[],  # no GPU here; the rest as on a Spark
        sparkple_pair_transport="socket",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    assert calls.count("rm --force sparkple-pair-check") == 2
    runs = [c.split() for c in calls if c.startswith("run ")]
    assert len(runs) == 2
    for argv in runs:
        image = argv.index("lab-image@sha256:0123")
        options = argv[:image]
        assert {"--rm", "--network=host", "--ipc=host", "--entrypoint=python3"} <= set(options)
        assert "--volume=/opt/sparkple:/opt/sparkple:ro" in options  # the package, read-only
        # the socket transport's variables (an ib pair's add NCCL_IB_HCA)
        for name in ("VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_NET"):
            assert f"--env={name}" in options  # by name: docker takes the task's value
        assert argv[image + 1 : image + 4] == ["-m", "sparkple.cli", "pair-check"]
    assert {next(a for a in argv if a.startswith("--rank=")) for argv in runs} == {
        "--rank=0",
        "--rank=1",
    }
    assert set(kept(releases)) == {"duo-head", "duo-worker"}


def test_the_playbook_fails_both_nodes_below_the_floor_and_still_keeps_the_figures(
    tmp_path: Path,
) -> None:
    releases = pair_inventory(tmp_path)
    done = play(tmp_path, sparkple_pair_check_floor_gbps=100000)
    assert done.returncode != 0
    figures = kept(releases)
    assert set(figures) == {"duo-head", "duo-worker"}
    assert figures["duo-head"]["ok"] is False and figures["duo-head"]["transport"] == "ib"
    assert "below the floor of 100000 GB/s" in figures["duo-head"]["message"]
    assert done.stdout.count("below the floor of 100000 GB/s for transport ib") >= 2
    assert "failed=1" in done.stdout.split("PLAY RECAP")[-1].replace(" ", "")


def test_the_playbook_refuses_a_pair_with_one_node_left_out(tmp_path: Path) -> None:
    releases = pair_inventory(tmp_path)
    alone = play(tmp_path, "-l", "duo-head", sparkple_pair_transport="socket")
    assert alone.returncode != 0
    assert "duo-head is in pair duo but its peer duo-worker is not in this run's batch" in (
        alone.stdout
    )
    assert kept(releases) == {}  # refused before any rank started


def test_a_python_without_torch_is_named_with_the_fix(tmp_path: Path) -> None:
    shadow = tmp_path / "torch"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('no torch in this Python')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    cmd = [sys.executable, "-m", "sparkple.cli", "pair-check", "--rank=0", "--pair=duo"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 1
    assert "rank 0 cannot import torch (no torch in this Python)" in done.stderr
    assert "sparkple_pair_check_launcher" in done.stderr


def test_the_module_imports_only_the_standard_library_until_it_measures() -> None:
    # sparkple.serving is imported by host programs on a bare python3: torch loads in measure()
    code = (
        "import json, sys\n"
        "import sparkple.cli, sparkple.pair.linkbench\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)}, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    foreign = set(json.loads(done.stdout)) - sys.stdlib_module_names - {"sparkple", "__main__"}
    assert not foreign, f"sparkple.pair.linkbench imports {sorted(foreign)}"
