"""The rendezvous stores' trust boundary (docs/control-plane.md, "Trust boundary"): where they listen, and what
a client without the cluster's token finds in them.

- The controller's store and a restart-mode generation's rank-0 store listen on the one address they are given
  (torch's own TCPStore server listens on every interface, whatever its host argument says).
- From another address — a network namespace this test creates, joined to the host by a veth pair in
  198.18.N.0/24 — nothing reaches a store bound to loopback; a store bound to the host's side of the link is
  reachable there and not on loopback (root only; skipped with the reason otherwise).
- Every key lives under a namespace derived from the cluster token: a client that connects without it finds
  none of a job's keys by the names the code uses, and no key holds the token. A standby's assignment is signed:
  a forged one is refused.
- End to end: a real cluster runs a restart-mode training job of 2 ranks; both of its stores listen on loopback
  only and a stranger's client finds none of its keys by name.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import timedelta

import pytest

from clusters import home, wait_for  # noqa: F401  (home is a fixture)
from conftest import tiny_config
from phalanx import protocol
from phalanx.control.backends.local import free_port
from phalanx.control.server.daemon import RendezvousStore

TOKEN = "a-cluster-token-for-this-test"
TIMEOUT = timedelta(seconds=10)



def _unavailable(why: str) -> None:
    """Without namespaces the test cannot run: a skip on a developer's machine, a failure in CI (CI runs as
    root and must exercise the real component)."""
    if os.environ.get("CI"):
        pytest.fail(f"CI cannot run the network-namespace test: {why}")
    pytest.skip(why)

def listeners(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on `port` (this network namespace, every process)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian 32-bit words
            found.add(socket.inet_ntop(family, raw))
    return found


def connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False


def rank_env(rank: int, port: int, host: str = "127.0.0.1", job: str = "3") -> dict[str, str]:
    return {protocol.MASTER_ADDR: host, protocol.MASTER_PORT: str(port), protocol.RANK: str(rank), protocol.WORLD_SIZE: "2",
            protocol.JOB_ID: job, protocol.CLUSTER_TOKEN: TOKEN}


# ---- where the stores listen ------------------------------------------------------------------------------
def test_the_controllers_store_and_a_generations_rank0_store_listen_only_on_their_address():
    controller_store = RendezvousStore("127.0.0.1", None, TOKEN)  # the controller's code path
    controller_store.set("k", "v")  # (waits for torch's server, started in a thread, to serve its socket)
    assert listeners(controller_store.port) == {"127.0.0.1"}  # torch alone: {"::"}, every interface
    assert controller_store.underlying_store.list_keys() == [f"{protocol.store_namespace(TOKEN)}/k"]

    port = free_port()
    rank0 = protocol.env_rendezvous_store(rank_env(0, port), TIMEOUT)  # what a restart-mode worker of rank 0 does
    rank1 = protocol.env_rendezvous_store(rank_env(1, port), TIMEOUT)
    assert listeners(port) == {"127.0.0.1"}
    rank1.set("hello", "1")  # the ranks still meet there, under the cluster's namespace
    assert rank0.get("hello") == b"1"
    assert rank0.underlying_store.list_keys() == [f"{protocol.store_namespace(TOKEN)}/hello"]

    # torchrun / srun (no agent, MASTER_ADDR not loopback): torch's env:// as before
    assert protocol.env_rendezvous_store({protocol.MASTER_ADDR: "node-0", protocol.MASTER_PORT: "1", protocol.RANK: "0"},
                                     TIMEOUT) is None


def test_the_controllers_store_is_bound_at_once_serves_early_clients_and_moves_off_a_taken_port():
    """Its socket listens before torch's server is up (started in a thread, off the controller's start-up path):
    a client that connects first is served once it is; a restart's port, when taken, gives way to a free one."""
    import torch.distributed as dist

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        store = RendezvousStore("127.0.0.1", taken.getsockname()[1], TOKEN)
        assert store.port != taken.getsockname()[1] and listeners(store.port) == {"127.0.0.1"}
        early = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
        early.set(f"{protocol.store_namespace(TOKEN)}/k", "v")
        assert store.get("k") == b"v"  # the controller's calls are namespaced


@pytest.fixture
def netns():
    """A network namespace joined to this host by a veth pair: (namespace, host side address). Root only."""
    if os.geteuid() != 0:
        _unavailable("creating a network namespace needs root (CI runs as root)")
    if shutil.which("ip") is None:
        _unavailable("iproute2's `ip` is not installed")
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout
    net = next((n for n in range(1 + os.getpid() % 200, 255) if f" 198.18.{n}." not in used), None)
    if net is None:
        _unavailable("no free 198.18.N.0/24 for the test link")
    tag = f"{os.getpid() % 100000}"
    ns, host_if, ns_if = f"phxsec{tag}", f"phxs{tag}h", f"phxs{tag}n"
    host_ip, ns_ip = f"198.18.{net}.1", f"198.18.{net}.2"

    def cleanup():
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)  # both ends of the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    setup = [["ip", "netns", "add", ns], ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
             ["ip", "link", "set", ns_if, "netns", ns], ["ip", "addr", "add", f"{host_ip}/24", "dev", host_if],
             ["ip", "link", "set", host_if, "up"],
             ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/24", "dev", ns_if],
             ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10)
    except subprocess.CalledProcessError as err:
        cleanup()
        _unavailable(f"cannot create a network namespace here ({' '.join(err.cmd)}: {err.stderr.strip()})")
    try:
        yield ns, host_ip
    finally:
        cleanup()


PROBE = """import json, socket, sys
out = []
for host, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((host, port), timeout=3).close()
        out.append(True)
    except OSError:
        out.append(False)
print(json.dumps(out))
"""


def reachable_from(ns: str, targets: list[tuple[str, int]]) -> list[bool]:
    """Whether a TCP client inside namespace `ns` connects to each (host, port)."""
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-I", "-S", "-c", PROBE, json.dumps(targets)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_client_on_another_address_cannot_reach_the_store(netns):
    import torch.distributed as dist

    ns, host_ip = netns
    default = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # what the code did before
    loopback = RendezvousStore("127.0.0.1", None, TOKEN)  # the default api.host
    rank0_port, rank0_on_link_port = free_port(), free_port(host_ip)
    rank0 = protocol.env_rendezvous_store(rank_env(0, rank0_port), TIMEOUT)  # noqa: F841 (listens while referenced)
    on_link = RendezvousStore(host_ip, None, TOKEN)  # api.host on the nodes' network
    for store in (loopback, on_link):  # torch's servers on their sockets (started in threads)
        store.settle(60)
    rank0_on_link = protocol.env_rendezvous_store(rank_env(0, rank0_on_link_port, host=host_ip), TIMEOUT)  # noqa: F841

    assert reachable_from(ns, [(host_ip, default.port), (host_ip, loopback.port), (host_ip, rank0_port),
                               (host_ip, on_link.port), (host_ip, rank0_on_link_port)]) == \
        [True, False, False, True, True]  # torch's own listens everywhere; ours only where they were put
    assert connects("127.0.0.1", loopback.port) and connects("127.0.0.1", rank0_port)
    assert not connects("127.0.0.1", on_link.port)  # and nowhere else
    assert listeners(on_link.port) == {host_ip}


# ---- what a client without the token finds ------------------------------------------------------------------
def test_a_jobs_keys_live_under_the_clusters_namespace_and_a_stranger_finds_none_by_name():
    import torch.distributed as dist

    from phalanx.resilience.membership import Membership

    master = keys = RendezvousStore("127.0.0.1", None, TOKEN)  # what the controller hands its scheduler
    addr = f"127.0.0.1:{master.port}"
    protocol.publish_generation(keys, "7", 2, ["workers-0", "workers-1"], 1)
    member = Membership(addr, "7", "workers-1", 0, token=TOKEN)  # the worker side (checkpointless)
    assert member.latest() == 2 and member.placement(2).rank == 1
    member.report_left(2)
    reporter = protocol.ProgressReporter(addr, "7", 2, 1, beat_s=0.1, token=TOKEN)
    try:
        reporter.report(5)
        wait_for(lambda: protocol.read_progress(keys, "7", 2, [1])[1]["step"] == 5, 10, "step 5 on the controller side")
    finally:
        reporter.close()

    stranger = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    by_name = [protocol.generation_key("7"), protocol.layout_key("7", 2), protocol.progress_key("7", 2, 1),
               protocol.alive_key("7", 2, 1), protocol.left_key("7", 2)]
    assert not any(stranger.check([k]) for k in by_name)  # the names the code used before find nothing
    other_cluster = protocol.namespaced(stranger, "another-clusters-token")
    assert not any(other_cluster.check([k]) for k in by_name)
    assert Membership(addr, "7", "workers-1", 0, token="another-clusters-token").latest() == 0
    listed = stranger.list_keys()
    namespace = protocol.store_namespace(TOKEN)
    assert TOKEN not in namespace and not any(TOKEN in k for k in listed)
    # Not a secret from a client that connects: TCPStore lists keys. The bind is the boundary (docs).
    assert listed and all(k.startswith(f"{namespace}/7/gen2/") or k == f"{namespace}/7/generation" for k in listed)


def test_a_standby_assignment_holds_no_token_and_a_forged_one_is_refused():
    env = protocol.worker_env(protocol.WorkerPlacement("7", 2, rank=1, world_size=2, local_rank=0, local_world_size=1,
                                               master_addr="127.0.0.1", master_port=1, store_addr="127.0.0.1:2",
                                               checkpoint_dir="/ck", cluster_token=TOKEN), base={})
    sealed = protocol.standby_assignment(TOKEN, "workers-2.0.99.1", env, "/jobs/7/logs/rank1.log")
    assert TOKEN not in sealed  # anyone who reaches the store can read it
    opened = protocol.open_standby_assignment(TOKEN, "workers-2.0.99.1", sealed.encode())
    assert opened["log"] == "/jobs/7/logs/rank1.log" and opened["env"][protocol.RANK] == "1"
    assert protocol.CLUSTER_TOKEN not in opened["env"]  # the standby has it from its agent

    forged = json.dumps({"body": json.dumps({"env": {"PHALANX_CONFIG": "/tmp/evil.json"}, "log": "/etc/x"}),
                         "mac": json.loads(sealed)["mac"]})
    for token, sid, raw in [(TOKEN, "workers-2.0.99.1", forged),  # changed body
                            ("another-clusters-token", "workers-2.0.99.1", sealed),  # signed by someone else
                            (TOKEN, "workers-3.0.98.1", sealed),  # replayed to another standby
                            (TOKEN, "workers-2.0.99.1", json.dumps({"env": {}, "log": "/etc/x"}))]:  # unsigned
        with pytest.raises(ValueError):
            protocol.open_standby_assignment(token, sid, raw)


# ---- end to end ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_running_jobs_stores_listen_on_loopback_only_and_hide_its_keys(tmp_path, home, demo_data):
    import torch.distributed as dist

    from phalanx.control.client.cluster import ClusterClient, create_cluster
    from phalanx.control.client.jobs import JobClient
    from phalanx.control.state.paths import ClusterPaths
    from test_jobs import step_at_least, write_config, write_spec

    create_cluster(write_spec(tmp_path, count=2, spares=0), timeout_s=60)
    jobs = JobClient("c1")
    config = tiny_config(tmp_path / "run", demo_data, training={"max_steps": 100000, "log_interval": 50},
                         checkpoint={"interval": 100000, "keep": 1})
    jobs.submit(write_config(tmp_path / "tiny.yaml", config), nodes=2, name="tiny")  # restart mode, 2 ranks
    step_at_least(jobs, "tiny", 2)
    info = jobs.describe("tiny")
    job_id, gen = str(info["id"]), info["generations"][0]
    host, port = protocol.parse_store_addr(ClusterClient("c1").describe()["store"]["addr"])

    assert listeners(port) == {"127.0.0.1"}  # the controller's store
    assert listeners(gen["master_port"]) == {"127.0.0.1"}  # rank 0's rendezvous of generation 1 (env:// before: ::)

    stranger = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    names = [protocol.progress_key(job_id, 1, r) for r in (0, 1)] + [protocol.alive_key(job_id, 1, r) for r in (0, 1)]
    assert not any(stranger.check([k]) for k in names)
    token = ClusterPaths.for_name("c1").read_token()
    assert not any(token in k for k in stranger.list_keys())
    progress = protocol.read_progress(protocol.namespaced(stranger, token), job_id, 1, [0, 1])  # with the token: there
    assert all(p["step"] is not None and p["step"] >= 1 for p in progress.values()), progress
    rank0 = dist.TCPStore(gen["master_addr"], gen["master_port"], is_master=False, wait_for_workers=False,
                          timeout=TIMEOUT)
    assert all(k.startswith(protocol.store_namespace(token) + "/") for k in rank0.list_keys())
    jobs.cancel("tiny")
