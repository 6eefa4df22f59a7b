"""Small helpers shared by the test modules that run expertmesh processes."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def serving_address(banner: str) -> str:
    """host:port from `expertmesh up`'s banner ("expertmesh is serving M on HOST:PORT — try: ...")."""
    return re.search(r" on (\S+:\d+) ", banner).group(1)


def wait_for(predicate, what: str, timeout_s: float = 60.0, poll_s: float = 0.1, explain=None):
    """``predicate()``'s first truthy value, polled every ``poll_s``; fails the test naming ``what`` past
    ``timeout_s`` (a bound on waiting, never a figure the test asserts), with ``explain()``'s text when given:
    where things stood, for a failure seen once on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"\n{explain()}" if explain else ""))
        time.sleep(poll_s)
    return value


def thread_stacks(*prefixes: str) -> str:
    """The stacks of this process's threads whose names start with one of ``prefixes`` (every thread without)."""
    import traceback

    frames = sys._current_frames()
    shown = []
    for thread in threading.enumerate():
        if thread.ident in frames and (not prefixes or thread.name.startswith(prefixes)):
            shown.append(f"--- thread {thread.name}\n" + "".join(traceback.format_stack(frames[thread.ident])))
    return "\n".join(shown)


def wait_stopped(pid: int, timeout_s: float = 10) -> None:
    """Until every thread of ``pid`` is in the stopped state (``T`` in /proc/PID/task/TID/stat): SIGSTOP is
    delivered asynchronously, and a call sent before it lands is served."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                states.append(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(s in "Tt" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s of SIGSTOP: thread states {states}")


def orchestrator_argv(state_url: str, model, placement, *flags: str, admin_port: int = 0) -> list[str]:
    """The command line of ``expertmesh orchestrator`` (text logs) over ``state_url``, ``model`` and the
    ``placement`` file, its admin API on 127.0.0.1:``admin_port`` (0: any free port), then ``flags``."""
    return [
        sys.executable,
        "-m",
        "expertmesh.cli.main",
        "--log-format",
        "text",
        "orchestrator",
        "--state-url",
        state_url,
        "--model",
        str(model),
        "--placement",
        str(placement),
        "--admin-host",
        "127.0.0.1",
        "--admin-port",
        str(admin_port),
        *flags,
    ]


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line of ``proc``'s stdout; "" if it exits first. Kills it past ``timeout``: a process
    that never prints must fail its test, not hang the suite in ``readline``."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"{proc.args!r} printed nothing in {timeout:.0f} s") from None


class Up:
    """`expertmesh up ARGS` as a process: waits for its banner, collects its stderr."""

    def __init__(self, *args, env=None, banner_timeout: float = 300):
        self.proc = subprocess.Popen(
            # Port 0, read back from the banner: a port picked in advance can be taken by one of
            # the Ray workers the command starts before it binds.
            [sys.executable, "-m", "expertmesh.cli.main", "up", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.banner = first_line(self.proc, timeout=banner_timeout)
        assert "expertmesh is serving" in self.banner, "".join(self.stderr)[-3000:]
        self.target = serving_address(self.banner)

    def stop(self, timeout=90) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def wait_for_stderr(self, pattern: str, timeout: float = 30) -> re.Match:
        """The first stderr line matching ``pattern`` (the reader thread may lag the banner)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.stderr):
                match = re.search(pattern, line)
                if match:
                    return match
            time.sleep(0.05)
        raise AssertionError(f"no stderr line matched {pattern!r}: {''.join(self.stderr)[-2000:]}")


class RayHead:
    """A Ray head of the test's own (``ray start --head --block`` in a session of its own), as multi-node Ray
    runs. Stopped by signalling that session only: ``ray stop`` would stop every Ray of the user on the machine."""

    def __init__(self, port: int, timeout: float = 120):
        self.address = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                os.path.join(os.path.dirname(sys.executable), "ray"),
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--num-cpus=2",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.output: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.output.append(line)
                if "block forever" in line:
                    ready.set()
            ready.set()  # exited: the check below reports it

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError(f"ray start did not come up: {''.join(self.output)[-3000:]}")

    def stop(self, grace: float = 5) -> None:
        """SIGTERM to its session, then SIGKILL once only ``ray start`` is left or after ``grace``: with
        ``--block`` it never exits on SIGTERM, and its gcs_server, raylet and monitor were seen alive 5 s
        after it (the old fixed 30 s wait cost every use 30 s). A test's own cluster has nothing to save."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while (
            time.monotonic() < deadline
            and self.proc.poll() is None
            and _session_members(self.proc.pid) - {self.proc.pid}
        ):
            time.sleep(0.1)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(timeout=10)


@contextmanager
def serving_http(path, ray_address: str, tokenizer=None):
    """`expertmesh up --http-port 0` over the checkpoint at ``path`` joined to the Ray at ``ray_address``:
    (up, url, model, tokenizer, path), stopped at the end."""
    from types import SimpleNamespace

    up = Up("--model", str(path), "--http-port", "0", "--ray-address", ray_address)
    try:
        url = up.wait_for_stderr(r"OpenAI-compatible HTTP API on (\S+)/v1").group(1)
        yield SimpleNamespace(up=up, url=url, model=path.name, tokenizer=tokenizer, path=path)
    finally:
        if up.proc.poll() is None:
            up.stop()


def _session_members(sid: int) -> set[int]:
    """The live pids of session ``sid`` (from /proc/PID/stat: its state and session fields; zombies left out)."""
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                members.add(int(entry))
    return members


def stock_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain transformers greedy decoding of one prompt with its own DynamicCache: the n tokens after it."""
    import torch
    from transformers import DynamicCache

    ids, cache, feed = list(prompt), DynamicCache(config=model.config), list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True).logits  # [1, n, V]
            feed = [int(logits[0, -1].argmax())]
            ids += feed
    return ids[len(prompt) :]


#: A sitecustomize that makes the packages the GPU machine lacks unimportable, as if not installed.
_ABSENT = """
import sys

class _Absent:
    NAMES = ("ray", "redis", "opentelemetry.sdk", "starlette", "uvicorn")

    def find_spec(self, name, path=None, target=None):
        if any(name == n or name.startswith(n + ".") for n in self.NAMES):
            raise ModuleNotFoundError(f"No module named {name!r} (not installed, as on the GPU machine)", name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""


def environment_without_gpu_machine_absentees(tmp_path) -> dict[str, str]:
    """This process's environment, for a child in which Ray, redis-py, the OpenTelemetry SDK and the HTTP
    API's starlette and uvicorn cannot be imported, nor in any process it starts (the PYTHONPATH carries
    over): the GPU machine has none of them."""
    site = tmp_path / "absent-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_ABSENT)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


class StepDispatcher:
    """What the serving engine's model runner needs of the dispatcher when the model computes its experts itself
    (a stock experts implementation): a step boundary, the routing epoch, and a step to run the forward in.
    ``epoch``: the routing epoch a request admitted now is served in; ``step_epoch`` (None: the same) the one
    the next step runs in (a view swapped in between admission and step)."""

    def __init__(self):
        self.epoch, self.step_epoch = 0, None
        #: the step contexts the forwards ran with
        self.contexts = []

    def begin_step(self):
        pass

    def routing_epoch(self):
        return self.epoch

    @contextmanager
    def step(self, context):
        context.epoch = self.epoch if self.step_epoch is None else self.step_epoch
        self.contexts.append(context)
        yield context


def bare_dispatcher(store, moe_layers, transport="auto", *, on_switch=None, model=None, **kwargs):
    """A router's layer dispatcher without a model, over a table watcher of its own that is not started (each
    step boundary reads the store; ``dispatcher.watcher.start()`` for the thread). ``on_switch``: called with
    each version switched to, where a router's heartbeat is; ``model``: the ModelIdentity tables must match."""
    from types import SimpleNamespace

    from expertmesh.router.assembly import assemble_router
    from expertmesh.router.transport import build

    heartbeat = SimpleNamespace(beat=on_switch) if on_switch is not None else None
    transport = build(transport) if isinstance(transport, str) else transport
    return assemble_router(store, moe_layers, transport, heartbeat=heartbeat, identity=model, **kwargs).dispatcher


def held_pairs(address: str) -> set[tuple[int, int]]:
    """The (layer, expert) pairs the expert group at ``address`` says it holds (Describe over gRPC)."""
    from expertmesh.infra.group_channels import group_channel
    from expertmesh.v1 import experts_pb2 as pb
    from expertmesh.v1 import experts_pb2_grpc as pb_grpc

    with group_channel(address) as channel:
        response = pb_grpc.ExpertGroupStub(channel).Describe(pb.DescribeRequest(), timeout=30)
    return {(e.layer, e.expert) for e in response.experts}


# -- certificates -------------------------------------------------------------------------


def write_pem(path: Path, key, cert) -> tuple[Path, Path]:
    """``cert`` and ``key`` as PEM files beside ``path`` (.crt, .key); returns their paths."""
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path.with_suffix(".crt"), path.with_suffix(".key")


def issue_certificate(
    cn: str, issuer: tuple | None, *, ca: bool = False, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()
):
    """(key, certificate) for ``cn``, signed by ``issuer`` = (key, cert), self-signed when None; serverAuth and
    clientAuth usages, ``dns`` names and ``ips`` addresses as subject alternative names."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    signer_key, signer_cert = issuer or (key, None)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(signer_cert.subject if signer_cert else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    if dns or ips:
        names = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(signer_key, hashes.SHA256())


def kernel_or_fallback(param: str, monkeypatch, module) -> str:
    """A test's path through ``module`` (one with a CPU kernel: ``load()`` and ``_built``): ``"kernel"`` builds it
    (a failed build fails the test, never a silent fallback), anything else makes the module take its fallback."""
    if param == "kernel":
        assert module.load(), f"{module.__name__}'s kernel did not build"
    else:
        monkeypatch.setattr(module, "_built", False)
    return param
