"""The multi-host fault bed (``bench chaos --hosts``): test hosts as network namespaces, their
pure parts (names, addresses, /proc/net/tcp, the scenario registry), the bed itself (root only)
and the benchmark end to end with short holds, asserting on counts only."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from expertmesh.bench.chaos import suite as bench_chaos
from expertmesh.bench.chaos.hosts import IFNAME_MAX, BedPlan, TestHosts, check_can_create, established, new_run_id, plan
from expertmesh.bench.chaos.hosts_platform import host_names
from expertmesh.bench.chaos.hosts_ray import NodeSpec, island_nodes, start_argv
from expertmesh.bench.chaos.measure import unhosted
from expertmesh.bench.report import BenchError
from expertmesh.contracts.topology import topology_from_dict
from expertmesh.expert_group.deployment import island_resource


def _can_make_namespaces() -> str:
    """Why this machine cannot make network namespaces ("" when it can)."""
    try:
        check_can_create()
    except BenchError as err:
        return str(err)
    return ""


_WHY_NOT = _can_make_namespaces()
needs_namespaces = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT or "network namespaces work here")


# -- pure parts --------------------------------------------------------------------------------


def test_a_bed_plan_gives_each_host_a_unique_name_port_and_address_in_one_private_24():
    bed = plan(host_names(3), run_id="12ab34cd")
    assert [h.name for h in bed.hosts] == ["redis", "orch", "router", "g0", "g1", "g2", "client"]
    subnet = ipaddress.IPv4Network(bed.subnet)
    assert subnet.prefixlen == 24 and subnet.is_private and subnet.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
    addresses = [ipaddress.IPv4Address(h.address) for h in bed.hosts]
    assert len(set(addresses)) == len(addresses)
    assert all(
        a in subnet and a not in (subnet.network_address, subnet.network_address + 1, subnet.broadcast_address)
        for a in addresses
    )
    names = [bed.switch, *(h.netns for h in bed.hosts)]
    assert len(set(names)) == len(names) and all("12ab34cd" in n for n in names)
    ports = [h.port for h in bed.hosts]
    assert len(set(ports)) == len(ports) and all(len(p) <= IFNAME_MAX for p in ports)
    assert BedPlan.from_dict(json.loads(json.dumps(bed.to_dict()))) == bed  # the driver in the bed reads it back


def test_runs_get_their_own_names_and_usually_their_own_subnet():
    # 1000 ids from one process: a 16-bit random suffix would collide here almost surely (p > 0.99)
    ids = [new_run_id() for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(len(i) == 8 for i in ids)
    assert len({plan(["a"], run_id=i).subnet for i in ids[:50]}) > 40
    assert plan(["a"], run_id="x").subnet == plan(["a"], run_id="x").subnet  # the id decides it


@pytest.mark.parametrize("names", [[], ["a", "a"], ["two words"], ["x" * 17]])
def test_a_bed_plan_refuses_bad_host_names(names):
    with pytest.raises(ValueError):
        plan(names)


def test_established_reads_ipv4_and_ipv4_mapped_ipv6_connections_only():
    header = "  sl  local_address rem_address   st tx_queue ...\n"
    tcp = header + (
        "   0: 0500A8C0:C3B4 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 1\n"  # listening
        "   1: 0500A8C0:C3B4 0400A8C0:DE84 01 00000000:00000000 00:00000000 00000000 0 0 2\n"
    )
    assert established(tcp) == [("192.168.0.5:50100", "192.168.0.4:56964")]
    tcp6 = header + "   0: 0000000000000000FFFF00000500A8C0:C3B4 0000000000000000FFFF00000400A8C0:DE84 01 0 0 0 0 0 3\n"
    assert established(tcp6) == [("192.168.0.5:50100", "192.168.0.4:56964")]


def test_unhosted_lists_the_experts_a_table_gives_no_group():
    replicas = {(0, 0): ("g0",), (0, 1): (), (1, 0): ("g0", "g1")}
    assert unhosted(replicas, [0, 1], 2) == [(0, 1), (1, 1)]
    assert unhosted({}, [3], 1) == [(3, 0)]


def test_every_host_scenario_has_its_fault_and_no_name_is_shared_with_the_loopback_ones():
    assert not set(bench_chaos.HOST_SCENARIOS) & set(bench_chaos.SCENARIOS)
    groups = ["g0", "g1", "g2"]
    table = SimpleNamespace(replicas={(0, e): (groups[e % 3], groups[(e + 1) % 3]) for e in range(4)})
    platform = SimpleNamespace(groups=groups, store=SimpleNamespace(routing_table=lambda: table))
    for name in bench_chaos.HOST_SCENARIOS:
        fault = bench_chaos._fault(name, None, platform, None)
        assert fault.name == name and fault.description
    sole = bench_chaos._fault("host-link-down-sole", None, platform, None)
    assert (
        sole.group in table.replicas[sole.sole] and sole.other in table.replicas[sole.sole] and sole.other != sole.group
    )
    move = bench_chaos._fault("orchestrator-cut-off-mid-migration", None, platform, None)
    assert move.source in table.replicas[(move.layer, move.expert)]
    assert move.target not in table.replicas[(move.layer, move.expert)]


def test_each_topology_node_declares_its_gpus_and_one_island_token_per_group():
    islands = [{"name": "a", "gpus": [{"id": 0}, {"id": 1}]}, {"name": "b", "gpus": [{"id": 2}]}]
    topology = topology_from_dict({"nodes": [{"name": "n", "islands": islands}]})
    a, b = island_resource("a"), island_resource("b")
    assert island_nodes(topology) == {"n": NodeSpec(1, 3, {a: 2.0, b: 1.0})}
    assert island_nodes(topology, group_per="island", num_cpus=2) == {"n": NodeSpec(2, 3, {a: 1.0, b: 1.0})}
    worker = start_argv("ray", island_nodes(topology)["n"], "10.1.2.4", head="10.1.2.3:6380")
    assert worker[:4] == ["ray", "start", "--address", "10.1.2.3:6380"] and "--head" not in worker
    assert worker[worker.index("--resources") + 1] == json.dumps({a: 2.0, b: 1.0}, sort_keys=True)
    assert worker[worker.index("--num-gpus") + 1] == "3" and worker[worker.index("--node-ip-address") + 1] == "10.1.2.4"
    head = start_argv("ray", NodeSpec(num_cpus=0), "10.1.2.3")
    assert "--head" in head and "--resources" not in head and head[head.index("--num-cpus") + 1] == "0"


def test_the_bed_says_it_needs_root_to_a_user_without_it(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(BenchError, match="bench chaos --hosts needs root for network namespaces"):
        check_can_create()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scenarios", "group-sigkill"], "--scenarios takes names from host-link-down-replicated,"),
        (["--groups", "2"], "orchestrator-cut-off-mid-migration needs --groups 3 or more"),
    ],
)
def test_bench_chaos_hosts_refuses_bad_flags_before_starting_anything(flags, message):
    before = _namespaces()
    proc = subprocess.run(
        [sys.executable, "-m", "expertmesh.cli.main", "bench", "chaos", "--hosts", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]
    assert _namespaces() <= before


# -- the bed -----------------------------------------------------------------------------------


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


@needs_namespaces
def test_test_hosts_connect_over_tcp_hide_each_others_tmpdir_cut_links_and_leave_nothing_behind():
    server_code = (
        "import os, socket, sys; open(os.path.join(os.environ['TMPDIR'], 'mine'), 'w').close(); "
        "s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen(); print('listening', flush=True); "
        "c, _ = s.accept(); c.sendall(b'hi'); c.recv(1)"
    )
    client_code = (
        "import os, socket, sys; print(os.listdir(os.environ['TMPDIR'])); "
        "print(socket.create_connection((sys.argv[1], 7000), timeout=5).recv(2).decode())"
    )
    with TestHosts(plan(["a", "b"])) as hosts:
        made = {hosts.bed.switch, *(h.netns for h in hosts.bed.hosts)}
        assert made <= _namespaces()
        a = hosts.address("a")
        server = subprocess.Popen(
            hosts.command("a", [sys.executable, "-c", server_code, a]), stdout=subprocess.PIPE, text=True
        )
        assert server.stdout.readline().strip() == "listening"
        reached = subprocess.run(
            hosts.command("b", [sys.executable, "-c", client_code, a]), capture_output=True, text=True, timeout=30
        )
        assert reached.stdout.split("\n")[:2] == ["[]", "hi"], reached.stderr  # a's file is not in b's TMPDIR
        # ... but in that of every command on a: one TMPDIR per host (a Ray node's drivers dial its sockets there)
        listing = "import os; print(os.listdir(os.environ['TMPDIR']))"
        again = subprocess.run(hosts.command("a", [sys.executable, "-c", listing]), capture_output=True, text=True)
        assert again.stdout.strip() == "['mine']", again.stderr
        assert (hosts.tmpdir("a") / "mine").exists() and not any(hosts.tmpdir("b").iterdir())
        server.wait(timeout=10)
        hosts.link("b", up=False)
        cut = subprocess.run(
            hosts.command("b", [sys.executable, "-c", client_code, a]), capture_output=True, text=True, timeout=30
        )
        # Unanswered: a timeout, or no route once the neighbour entry went (never a refusal).
        assert cut.returncode != 0 and ("timed out" in cut.stderr or "No route to host" in cut.stderr), cut.stderr
        hosts.link("b", up=True)
        sleeper = subprocess.Popen(hosts.command("a", ["sleep", "60"]))
        time.sleep(0.5)
        assert hosts.kill("a") >= 1 and sleeper.wait(timeout=10) == -9
    assert not made & _namespaces()


@needs_namespaces
def test_test_hosts_remove_what_they_made_when_making_them_fails():
    bed = plan(["a", "b"])
    broken = BedPlan(bed.run_id, bed.switch, bed.subnet, (bed.hosts[0], bed.hosts[0]))  # one netns twice: fails
    with pytest.raises(BenchError):
        TestHosts(broken).open()
    assert not {bed.switch, bed.hosts[0].netns} & _namespaces()


# -- the benchmark, end to end -----------------------------------------------------------------


@pytest.mark.slow
@needs_namespaces
def test_bench_chaos_hosts_every_host_fault_heals_with_no_wrong_output_and_no_unhosted_expert(tmp_path):
    """Every multi-host scenario with short holds, run as an operator would (the command makes the
    bed, runs inside its client host, and deletes it). The promises, as counts: no wrong output
    anywhere; no failed request where every expert kept a replica elsewhere; no expert ever
    without a replica in the table; every fault heals; the router reached every group by gRPC
    over TCP (never shared memory)."""
    out = tmp_path / "chaos-hosts.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertmesh.cli.main",
            "bench",
            "chaos",
            "--hosts",
            "--clients",
            "2",
            "--max-new-tokens",
            "8",
            "--quiet-seconds",
            "1",
            "--hold-seconds",
            "4",
            "--health-interval",
            "2",
            "--health-tokens",
            "128",
            "--deadline",
            "120",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_id,) = re.findall(r"\(namespaces em([0-9a-f]+)-\*\)", proc.stderr)
    assert not [n for n in _namespaces() if n.startswith(f"em{run_id}-")]  # the bed is gone
    result = json.loads(out.read_text())
    by_name = {s["scenario"]: s for s in result["scenarios"]}
    for s in result["scenarios"]:
        assert s["recovered"], s
    assert list(by_name) == list(bench_chaos.HOST_SCENARIOS)
    for s in result["scenarios"]:
        assert s["sent"] > 0 and s["wrong_outputs"] == 0, s
        assert s["experts_unhosted"] == [] and s["table_reads"] > 0, s
    for name in (
        "host-link-down-replicated",
        "redis-host-cut-off",
        "orchestrator-cut-off-mid-migration",
        "group-host-killed",
    ):
        s = by_name[name]
        assert s["failed"] == 0, f"{name}: {s['failed']} of {s['sent']} failed: {s['failures']}"
    assert result["steady"]["failed"] == 0 and result["steady"]["wrong_outputs"] == 0
    setup = result["setup"]
    assert set(setup["group_transports"]) == {"g0", "g1", "g2"}
    assert set(setup["group_transports"].values()) <= {"grpc-stream", "grpc-unary"}, setup["group_transports"]
    assert all(setup["router_tcp_to_groups"].values()), setup["router_tcp_to_groups"]
    print(proc.stdout)
